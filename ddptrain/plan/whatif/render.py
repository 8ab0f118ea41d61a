"""The dry run's what-if answer: a measured run's step predicted on the target layout and the ones on the way."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from ddptrain.config.schema import PlanConfig
from ddptrain.errors import ConfigError
from ddptrain.plan.costs import chosen_link, preset_link
from ddptrain.plan.whatif.calibration import Calibration
from ddptrain.plan.whatif.layout import Layout
from ddptrain.plan.whatif.predictor import predict


def render_prediction(cal: Calibration, run_dir: str, layouts: list[Layout]) -> str:
    """A table of predicted step time, exposed communication, tokens/s and scaling efficiency per layout."""
    single = predict(cal, Layout(1, 1, layouts[0].intra, layouts[0].inter))
    out = Console(file=io.StringIO(), width=160, record=True, color_system=None)
    where = "measured" if cal.buckets_measured else "not measured: one bucket of 4 bytes/parameter, no overlap"
    out.print(f"Calibrated from {run_dir} ({cal.world_size} rank(s)): {cal.micro_step_s * 1e3:.1f} ms compute per "
              f"micro-batch, optimizer {cal.optimizer_s * 1e3:.1f} ms, {len(cal.buckets)} gradient bucket(s) "
              f"of {sum(n for _, n in cal.buckets) / 1e6:.2f} MB ({where}), hook {cal.hook_s * 1e3:.2f} ms per bucket")
    out.print(f"Rank skew: the ranks waited {cal.skew:.1%} of their busy time for the slowest one (the run's "
              "straggler telemetry; none on one rank)")
    table = Table(title=f"Predicted with {cal.micro_batch_size} x {cal.grad_accum} sequences per rank per step "
                        "(weak scaling)")
    for column in ("layout", "global batch", "step", "compute", "comm", "exposed", "tokens/s", "efficiency"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for layout in layouts:
        p = predict(cal, layout)
        table.add_row(layout.describe(), str(p.batch.global_batch_size), f"{p.step_s * 1e3:,.1f} ms",
                      f"{p.compute_s * 1e3:,.1f} ms", f"{p.comm_s * 1e3:,.2f} ms", f"{p.exposed_s * 1e3:,.2f} ms",
                      f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / (layout.world_size * single.tokens_per_s):.1%}")
    out.print(table)
    for link in dict.fromkeys((layouts[0].intra, layouts[0].inter)):
        out.print(f"link {link.name}: {link.bandwidth_gbps:g} GB/s bus bandwidth, α {link.latency_us:g} µs "
                  f"({link.note})")
    return out.export_text()


def what_if(cfg: PlanConfig, launch_world_size: int) -> str:
    """The dry run's answer to ``plan.from_run``: the target layout, the node counts up to it, and a flat ring."""
    world_size = cfg.world_size or launch_world_size
    if cfg.nodes < 1 or world_size % cfg.nodes:
        raise ConfigError(f"plan.nodes={cfg.nodes}: expected a positive divisor of plan.world_size={world_size}")
    assert cfg.from_run is not None
    cal = Calibration.from_run(cfg.from_run)
    intra, inter = chosen_link(cfg), preset_link("plan.inter_node", cfg.inter_node)
    per_node = world_size // cfg.nodes
    nodes = sorted({1, *(2**k for k in range(cfg.nodes.bit_length()) if 2**k < cfg.nodes), cfg.nodes})
    layouts = [Layout(1, 1, intra, inter)] if per_node > 1 else []
    layouts += [Layout(per_node * m, m, intra, inter, cfg.hierarchical) for m in nodes]
    if cfg.nodes > 1:
        layouts.append(Layout(world_size, cfg.nodes, intra, inter, not cfg.hierarchical))
    return render_prediction(cal, cfg.from_run, layouts)
