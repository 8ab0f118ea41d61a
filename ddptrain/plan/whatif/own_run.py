"""Every run checks the predictor on itself: its step predicted from its own compute and buckets, beside the
measured one, in ``summary.json``'s ``predicted`` record.

The prediction reads the run's compute phases and bucket profile, never its measured communication times; the
link is the measured one when ``plan.bandwidth_gbps`` (and ``plan.latency_us``) are set, otherwise the preset of
``plan.interconnect`` on GPUs or, for gloo on CPU, ``GLOO_LOOPBACK``. The compute was measured with the run's
own ranks beside each other, so whatever they took from each other is already in it; the wait for the slowest
rank is the one the run's own straggler telemetry measured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ddptrain.config.schema import PlanConfig
from ddptrain.plan.costs import Link, chosen_link, preset_link
from ddptrain.plan.whatif.calibration import Calibration
from ddptrain.plan.whatif.layout import Layout
from ddptrain.plan.whatif.predictor import predict
from ddptrain.telemetry.summary import RunSummary

# gloo over loopback TCP between processes of one host, a round figure between what scripts/bench_collectives.py
# fitted on a 2-core machine quiet (0.75-0.8 GB/s, α 0.2-0.3 ms) and loaded (0.55-1.7 GB/s, α up to 0.7 ms).
# A measured link beats it: pass plan.bandwidth_gbps/plan.latency_us from the benchmark of your own group.
GLOO_LOOPBACK = Link("gloo_loopback", 1.0, 600.0, "gloo over loopback TCP on one 2-core host, fitted by "
                     "scripts/bench_collectives.py")


def own_link(plan: PlanConfig, device_type: str) -> tuple[Link, str]:
    """The link a run's self-prediction uses, and where it came from."""
    if plan.bandwidth_gbps:
        return chosen_link(plan), "measured: plan.bandwidth_gbps/plan.latency_us"
    if device_type == "cpu":
        alpha = GLOO_LOOPBACK.latency_us if plan.latency_us is None else plan.latency_us
        return replace(GLOO_LOOPBACK, latency_us=alpha), "gloo loopback default (no plan.bandwidth_gbps)"
    return chosen_link(plan), f"preset plan.interconnect={plan.interconnect}"


def _error_pct(predicted: float, measured: float | None) -> float | None:
    return None if not measured else 100.0 * (predicted - measured) / measured


def predict_own_step(summary: RunSummary, plan: PlanConfig, device_type: str, nodes: int) -> dict[str, Any]:
    """The ``predicted`` fields of a finished run: step and exposed communication, predicted vs measured."""
    if summary.world_size == 1:
        return {"step_note": "1 rank: no gradient sync, nothing to predict"}
    if summary.zero_stage != 0 or summary.compression != "none":
        return {"step_note": "the predictor models DDP's uncompressed all-reduce (parallel.zero_stage=0)"}
    try:
        cal = Calibration.from_summary(summary)
    except (KeyError, TypeError, ValueError):
        return {"step_note": "no step breakdown was timed: nothing to predict from"}
    link, source = own_link(plan, device_type)
    layout = Layout(summary.world_size, nodes, link, preset_link("plan.inter_node", plan.inter_node),
                    plan.hierarchical)
    p = predict(cal, layout)
    return {
        "step_s": p.step_s,
        "exposed_comm_s": p.exposed_s,
        "link": {"name": link.name, "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                 "source": source},
        "layout": layout.describe(),
        "step_error_pct": _error_pct(p.step_s, summary.steady.time_step_s),
        "exposed_comm_error_pct": _error_pct(p.exposed_s, summary.steady.time_exposed_comm_s),
    }
