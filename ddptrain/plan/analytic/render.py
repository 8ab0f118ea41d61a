"""The dry run's text: a plan (``ddptrain/plan/analytic/planner.py``) as plain lines and rich tables, in human units."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from ddptrain.config.choices import ZERO_STAGES
from ddptrain.plan.analytic.planner import Plan
from ddptrain.plan.costs import GB

GiB = 1024**3


def _human(value: float, units: list[tuple[float, str]]) -> str:
    """``value`` in the largest unit it reaches (the smallest unit below that)."""
    scale, name = next(((s, u) for s, u in units if value >= s), units[-1])
    return f"{value / scale:,.2f} {name}"


def _count(value: float) -> str:
    return _human(value, [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")])


def _mem(nbytes: float) -> str:
    return _human(nbytes, [(1024**4, "TiB"), (GiB, "GiB"), (1024**2, "MiB"), (1024, "KiB")])


def _vol(nbytes: float) -> str:
    return _human(nbytes, [(1e12, "TB"), (GB, "GB"), (1e6, "MB"), (1e3, "kB")])


def _time(seconds: float) -> str:
    return _human(seconds, [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs")])


_STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _overlap_verdict(plan: Plan) -> str:
    if plan.backward_s is None or plan.overlap_ratio is None:
        return "Overlap: unknown device peak; set metrics.peak_tflops to judge whether communication hides."
    head = (
        f"Overlap on {plan.link.name}: communication {_time(plan.comm_s)} vs backward of one micro-batch "
        f"{_time(plan.backward_s)} (at {plan.assumed_mfu:.0%} MFU of {plan.peak_tflops:,.0f} TFLOP/s): "
    )
    if plan.overlap_ratio <= 1.0:
        return head + f"hides under backward (ratio {plan.overlap_ratio:.2f})."
    exposed = plan.comm_s - plan.backward_s
    return head + f"cannot hide (ratio {plan.overlap_ratio:.2f}), about {_time(exposed)} exposed per step."


def render_plan(plan: Plan) -> str:
    """The plan as plain text with rich tables: batch, memory by component and stage, communication, overlap."""
    out = Console(file=io.StringIO(), width=110, record=True, color_system=None)
    stage = plan.zero_stage
    out.print(
        f"Model: {_count(plan.params)} parameters ({plan.params_source}); "
        f"{_count(plan.flops_per_token)}FLOP per token ({plan.flops_rule})"
    )
    if plan.frozen_note:
        out.print(f"Trainable: {_count(plan.trainable)} LoRA adapter parameters ({plan.frozen_note}); only their "
                  "gradients are all-reduced")
    out.print(f"Batch: {plan.batch.equation()}")
    p = plan.precision
    out.print(f"Precision: {p.name} ({p.param_bytes} + {p.grad_bytes} + {p.optim_bytes} bytes per parameter, "
              f"+ {p.gathered_bytes} per parameter FSDP2 holds gathered)")
    chosen = Table(title=f"Model state per rank: {_STAGE_NAMES[stage]} on {plan.batch.dp} ranks")
    for column in ("component", "bytes per model parameter", "per rank"):
        chosen.add_column(column, justify="left" if column == "component" else "right")
    mem = plan.memory[stage]
    for label, nbytes in (("parameters", mem.params), ("gradients", mem.grads), ("optimizer", mem.optimizer)):
        chosen.add_row(label, f"{nbytes / plan.params:.4g}", _mem(nbytes))
    chosen.add_row("total", f"{mem.total / plan.params:.4g}", _mem(mem.total))
    out.print(chosen)

    stages = Table(title=f"Across ZeRO stages on {plan.batch.dp} ranks (model state only, no activations)")
    for column in ("stage", "parameters", "gradients", "optimizer", "total", "comm per step"):
        stages.add_column(column, justify="left" if column == "stage" else "right")
    for s in ZERO_STAGES:
        m = plan.memory[s]
        marker = " ←" if s == stage else ""
        stages.add_row(
            f"{s} {_STAGE_NAMES[s]}{marker}",
            _mem(m.params),
            _mem(m.grads),
            _mem(m.optimizer),
            _mem(m.total),
            _vol(plan.comm[s].nbytes),
        )
    out.print(stages)

    comm = plan.comm[stage]
    links = Table(title=f"Communication per rank per step: {_vol(comm.nbytes)} ({_STAGE_NAMES[stage]}, ring)")
    for column in ("interconnect", "bandwidth", "latency α", "predicted time", "assumption"):
        links.add_column(column, justify="right" if column in ("bandwidth", "latency α", "predicted time") else "left")
    for link in plan.links:
        links.add_row(
            link.name,
            f"{link.bandwidth_gbps:,.4g} GB/s",
            f"{link.latency_us:g} µs",
            _time(link.seconds(comm)),
            link.note,
        )
    out.print(links)
    out.print(_overlap_verdict(plan))
    return out.export_text()
