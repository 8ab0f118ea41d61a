"""What-if predictor: a measured run's step time, carried to other world sizes and node layouts.

Calibration comes from a run's ``summary.json``: per-rank compute (data, forward, backward, optimizer), the
batch, and the gradient buckets of a timed step, each with when it became ready (seconds before backward's
compute ended) and its size. Links are α–β models: the planner's presets, or a fit of the real process group
(``scripts/bench_collectives.py``). For a target of N ranks on M nodes:

- weak scaling: every rank keeps the calibration run's work per step (micro batch x grad_accum), so the
  global batch grows with N and compute per rank stays as measured;
- each bucket's all-reduce starts when the bucket is ready and the previous bucket's all-reduce has finished,
  so it can only hide behind the backward compute that follows it; what runs past the end of backward is exposed;
- one node: a ring over the intra-node link. Several nodes: a flat ring pays the inter-node link on every hop,
  a hierarchical one reduce-scatters within the node, all-reduces 1/g of the data across nodes and all-gathers
  within the node again (g ranks per node).

Not modelled: compute slowing down from contention, stragglers, and collectives other than the gradient sync.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ddptrain.config import PlanConfig
from ddptrain.data.batch import BatchPlan
from ddptrain.errors import ConfigError
from ddptrain.plan import Link, chosen_link, preset_link


@dataclass(frozen=True)
class Calibration:
    """What the predictor takes from a measured run."""

    world_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    micro_step_s: float  # data + forward + backward compute of one micro-batch on one rank
    optimizer_s: float
    buckets: list[tuple[float, int]]  # (seconds before backward compute ended that it was ready, bytes)
    buckets_measured: bool  # False: one bucket of all fp32 gradients, ready when backward ends (no overlap)

    @classmethod
    def from_run(cls, run_dir: str) -> Calibration:
        path = Path(run_dir) / "summary.json"
        try:
            s = json.loads(path.read_text())
            micro = (s["time_data_s"] + s.get("time_forward_sync_s", 0.0) + s["time_forward_s"]
                     + s["time_backward_s"]) / s["grad_accum"]
            buckets = [(float(lead), int(n)) for lead, n in s.get("buckets") or []]
            measured = bool(buckets)
            buckets = buckets or [(0.0, 4 * int(s["parameters"]))]
            return cls(s["world_size"], s["global_batch_size"], s["micro_batch_size"], s["grad_accum"], s["seq_len"],
                       micro, s["time_optimizer_s"], buckets, measured)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"plan.from_run={run_dir}: expected a finished run directory with a summary.json "
                              f"holding the step breakdown ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class Layout:
    """N ranks as ``nodes`` x ``ranks_per_node``, the links within and between nodes, and the all-reduce shape."""

    world_size: int
    nodes: int
    intra: Link
    inter: Link
    hierarchical: bool = True

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    def describe(self) -> str:
        if self.nodes == 1:
            return f"1 node x {self.world_size} ({self.intra.name})"
        ring = "hierarchical" if self.hierarchical else "flat ring"
        return f"{self.nodes} nodes x {self.ranks_per_node} ({self.intra.name} + {self.inter.name}, {ring})"


def _ring(nbytes: float, ranks: int, link: Link, passes: int) -> float:
    """``passes`` ring passes (1: reduce-scatter or all-gather, 2: all-reduce) of ``nbytes`` over ``ranks``."""
    if ranks <= 1:
        return 0.0
    hops = passes * (ranks - 1)
    return hops * link.latency_us * 1e-6 + hops / ranks * nbytes / (link.bandwidth_gbps * 1e9)


def allreduce_seconds(nbytes: float, layout: Layout) -> float:
    """One all-reduce of ``nbytes`` over the layout (α–β, ring)."""
    g, m = layout.ranks_per_node, layout.nodes
    if m == 1:
        return _ring(nbytes, g, layout.intra, 2)
    if not layout.hierarchical:  # every hop of one big ring waits for the slowest link
        slow = layout.inter if layout.inter.bandwidth_gbps < layout.intra.bandwidth_gbps else layout.intra
        return _ring(nbytes, g * m, slow, 2)
    return 2 * _ring(nbytes, g, layout.intra, 1) + _ring(nbytes / g, m, layout.inter, 2)


def exposed_comm(buckets: list[tuple[float, int]], seconds: Callable[[float], float]) -> tuple[float, float]:
    """(exposed, total) communication of one sync: buckets all-reduce one at a time, each from when it is ready.

    Time 0 is the end of backward's compute; bucket i is ready at ``-lead_i``. Exposed is how far the last
    all-reduce runs past 0.
    """
    clock = -math.inf
    total = 0.0
    for lead, nbytes in buckets:
        duration = seconds(nbytes)
        clock = max(clock, -lead) + duration
        total += duration
    return max(0.0, clock) if buckets else 0.0, total


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    batch: BatchPlan
    compute_s: float
    exposed_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch.tokens_per_step / self.step_s


def predict(cal: Calibration, layout: Layout) -> Prediction:
    """The step of ``cal``'s run on ``layout``, each rank doing the work per step that it did (weak scaling)."""
    per_rank = cal.micro_batch_size * cal.grad_accum
    batch = BatchPlan.derive(per_rank * layout.world_size, cal.micro_batch_size, cal.grad_accum, layout.world_size,
                             cal.seq_len)
    compute = cal.micro_step_s * batch.grad_accum + cal.optimizer_s
    exposed, comm = exposed_comm(cal.buckets, lambda n: allreduce_seconds(n, layout))
    return Prediction(layout, batch, compute, exposed if layout.world_size > 1 else 0.0, comm)


def render_prediction(cal: Calibration, run_dir: str, layouts: list[Layout]) -> str:
    """A table of predicted step time, exposed communication, tokens/s and scaling efficiency per layout."""
    single = predict(cal, Layout(1, 1, layouts[0].intra, layouts[0].inter))
    out = Console(file=io.StringIO(), width=160, record=True, color_system=None)
    where = "measured" if cal.buckets_measured else "not measured: one bucket of 4 bytes/parameter, no overlap"
    out.print(f"Calibrated from {run_dir} ({cal.world_size} rank(s)): {cal.micro_step_s * 1e3:.1f} ms compute per "
              f"micro-batch, optimizer {cal.optimizer_s * 1e3:.1f} ms, {len(cal.buckets)} gradient bucket(s) "
              f"of {sum(n for _, n in cal.buckets) / 1e6:.2f} MB ({where})")
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
