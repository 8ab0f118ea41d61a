"""The α–β model of the real process group: time all-reduces of several sizes and fit t = 2(N-1)·α + 2(N-1)/N·S/B.

The fit calibrates the what-if predictor (``plan.latency_us`` = α, ``plan.bandwidth_gbps`` = B) with the
link that a run actually has instead of a datasheet figure.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ddptrain.plan.costs import Link

SIZES = tuple(4 * 4**k for k in range(3, 12))  # 256 B .. 16 MiB: up to the largest DDP bucket (25 MB)


def fit_link(sizes: list[int], seconds: list[float], world_size: int) -> Link:
    """Least-squares line through (bytes, seconds) read as a ring all-reduce: intercept -> α, slope -> B."""
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(seconds) / n
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds, strict=True)) / sum(
        (s - mean_s) ** 2 for s in sizes)
    intercept = mean_t - slope * mean_s
    hops = 2 * (world_size - 1)
    return Link("measured", hops / world_size / slope / 1e9, max(intercept, 0.0) / hops * 1e6,
                f"fit of all-reduce timings on {world_size} ranks")


def measure_link(sizes: tuple[int, ...] = SIZES, repeats: int = 20) -> Link:
    """Median all-reduce time of each size on the default group (a collective: every rank calls it)."""
    medians = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        for _ in range(3):  # warm-up: connections, allocations
            dist.all_reduce(buf)
        medians.append(allreduce_median_s(buf, repeats))
    return fit_link(list(sizes), medians, dist.get_world_size())


def allreduce_median_s(buf: torch.Tensor, repeats: int) -> float:
    """Median time of an all-reduce of ``buf`` that every rank starts together (a barrier before each)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
