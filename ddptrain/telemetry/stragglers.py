"""Which rank holds the others up: every rank's step, compute and data time per logged window, gathered.

In synchronous data parallelism every rank's step takes as long as the slowest rank's work, so the step time
itself is nearly equal everywhere; the straggler is the rank with the most *busy* time (data + compute) while
the others spend that difference waiting in the gradient collectives. Each window logs every rank's figures,
``slowest_rank`` and ``rank_skew_pct`` (slowest vs median busy time). A rank that is slowest by more than
``metrics.straggler_pct`` in most of the last ``metrics.straggler_windows`` windows gets one warning naming
its rank, host, and the cause: data (its loader) or compute (its device), whichever exceeds the median more.
Waiting is what the other ranks do meanwhile (``rank_wait_s``); when every rank waits alike, the skew stays
low and the time lost is the network's, not a rank's. ``rank_wait_for_slowest_pct`` is what the skew costs: the
mean over ranks of the slowest rank's busy time less their own, in percent of their mean busy time; the what-if
predictor takes its rank skew from it.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

import torch.distributed as dist

log = logging.getLogger("ddptrain")
COMPUTE_PHASES = ("time_forward_s", "time_backward_s", "time_optimizer_s")


def rank_times(window: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """(step, compute, data, wait) seconds per step of this rank's window; None when no step was timed."""
    if "time_step_s" not in window:
        return None
    compute = sum(window.get(k, 0.0) for k in COMPUTE_PHASES)
    wait = window.get("time_exposed_comm_s", 0.0) + window.get("time_forward_sync_s", 0.0)
    return window["time_step_s"], compute, window.get("time_data_s", 0.0), wait


def skew(busy: list[float]) -> tuple[int, float]:
    """The slowest rank and how much longer it was busy than the median rank, in percent."""
    slowest = max(range(len(busy)), key=busy.__getitem__)
    median = statistics.median(busy)
    return slowest, (100.0 * (busy[slowest] - median) / median if median > 0 else 0.0)


def wait_for_slowest_pct(busy: list[float]) -> float:
    """How long the ranks wait for the slowest one, on average, in percent of their mean busy time."""
    mean = statistics.fmean(busy)
    return 100.0 * (max(busy) - mean) / mean if mean > 0 else 0.0


class StragglerMonitor:
    """Gathers every rank's window timing (a collective: call it on every rank) and names persistent stragglers."""

    def __init__(self, hosts: list[str], windows: int, threshold_pct: float) -> None:
        self.hosts = hosts
        self.threshold_pct = threshold_pct
        self.recent: deque[int | None] = deque(maxlen=windows)  # per window: the rank over the threshold, if any
        self.warned: set[int] = set()

    def window(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The per-rank figures of this window (every rank gets them); warns once per persistent straggler."""
        mine = rank_times(metrics)
        every: list[tuple[float, float, float, float] | None] = [mine] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if any(t is None for t in every):  # every rank samples the same steps, so all or none are timed
            return {}
        step, compute, data, wait = (list(col) for col in zip(*every, strict=True))  # type: ignore[misc]
        busy = [c + d for c, d in zip(compute, data, strict=True)]
        slowest, skew_pct = skew(busy)
        self.recent.append(slowest if skew_pct > self.threshold_pct else None)
        self._maybe_warn(slowest, skew_pct, compute, data)
        return {"rank_step_s": step, "rank_compute_s": compute, "rank_data_s": data, "rank_wait_s": wait,
                "rank_skew_pct": skew_pct, "rank_wait_for_slowest_pct": wait_for_slowest_pct(busy),
                "slowest_rank": slowest}

    def _maybe_warn(self, rank: int, skew_pct: float, compute: list[float], data: list[float]) -> None:
        persistent = self.recent.count(rank) > self.recent.maxlen // 2  # type: ignore[operator]
        if not persistent or rank in self.warned:
            return
        self.warned.add(rank)
        extra_data = data[rank] - statistics.median(data)
        extra_compute = compute[rank] - statistics.median(compute)
        cause = "data" if extra_data >= extra_compute else "compute"
        if dist.get_rank() == 0:
            log.warning(
                "straggler: rank %d on %s is the slowest in %d of the last %d windows (%.0f%% over the median "
                "rank; %s +%.0f ms per step over the median); the other ranks wait for it",
                rank, self.hosts[rank], self.recent.count(rank), len(self.recent), skew_pct,
                cause, 1e3 * max(extra_data, extra_compute),
            )
