"""The CPU host fit: how ranks that share a host's cores change a step, measured on the real process group and
fed to the what-if predictor as its ``HostTerms``. Validation apparatus for this kind of machine (gloo ranks on
shared CPU cores), used by ``scripts/bench_collectives.py`` and ``scripts/validate_predictor.py``; with a GPU per
rank and NCCL on its own stream these terms are neutral, so the product's predictor has none.

A 1-rank run times compute on a host that one rank has to itself. At N ranks three things change that an α–β
fit of the all-reduce does not see, and each is measured here with one fixed compute kernel (an MLP's forward
and backward, the matmul-plus-elementwise mix of a transformer block):

- ``contention``: the kernel's time with every rank computing at once over its time on one rank alone. Ranks
  sharing CPU cores, memory bandwidth or a hypervisor's siblings slow each other; with one GPU per rank it is ~1.
- ``steal_us_per_mb``: the compute a rank loses per MB that its collectives reduce beside it. On CPU gloo's
  threads reduce and copy on the same cores as the model, work in proportion to the bytes (a latency-bound
  small all-reduce, long in flight, takes little); NCCL runs on its own stream: ~0 on GPUs.
- ``busy_latency_us``/``busy_bandwidth_gbps``: the α–β fit of all-reduces that run while the rank computes, as
  DDP's buckets do during backward (gloo's threads must wake up on cores busy with compute); None on GPUs,
  where a collective sees the same link whether or not the device computes.
- ``queued_latency_us``: α of an all-reduce launched while the previous one is still in flight beside compute,
  as DDP's consecutive buckets are: gloo's thread is already awake, so it may pay less than the busy α; from
  a train of small all-reduces launched back to back beside compute (their bytes on the busy bandwidth).
- ``skew_us``/``skew``: how long a rank waits at a collective for the slowest rank, ``skew_us`` plus ``skew`` x
  the compute since the last sync: a line through the waits after units of compute of two lengths (jitter
  does not grow in proportion to the compute). Equal work finishes at different times when ranks are jostled;
  a 1-rank calibration run cannot measure it, so this fit supplies it for the 1 -> 2 rank validation.

Means, not medians, for the times that a step pays in full however they are spread (waits, busy all-reduces,
whose times on a busy CPU are mostly short and sometimes a scheduler slice long).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from linkfit import allreduce_median_s, fit_link

from ddptrain.plan.costs import Link
from ddptrain.plan.whatif.layout import Layout, allreduce_seconds
from ddptrain.plan.whatif.overlap import SyncTimeline


@dataclass(frozen=True)
class HostFit:
    """Measured host-side terms of N ranks; the defaults (a rank per dedicated device) change nothing."""

    contention: float = 1.0  # compute time, every rank computing at once / one rank alone
    steal_us_per_mb: float = 0.0  # compute lost per MB all-reduced beside it
    busy_latency_us: float | None = None  # α of all-reduces while the rank computes; None: the link's own
    busy_bandwidth_gbps: float | None = None  # B of all-reduces while the rank computes; None: the link's own
    skew: float = 0.0  # wait for the slowest rank at a sync per second of compute since the previous sync
    queued_latency_us: float | None = None  # α of an all-reduce queued behind one in flight; None: the idle link's
    skew_us: float = 0.0  # that wait's part that does not grow with the compute

    def wait_s(self, compute_s: float) -> float:
        """The mean wait for the slowest rank at a sync after ``compute_s`` of compute."""
        return self.skew_us * 1e-6 + self.skew * compute_s

    def sync_timeline(self, buckets: list[tuple[float, int]], layout: Layout, hook_s: float,
                      wait: float) -> SyncTimeline:
        """The sync on ``layout`` with collectives beside compute: on the busy link, stealing compute."""
        busy = queued = None
        if self.busy_bandwidth_gbps:
            busy = _beside_compute(layout, self.busy_bandwidth_gbps, self.busy_latency_us or 0.0, hook_s)
            queued_alpha = layout.intra.latency_us if self.queued_latency_us is None else self.queued_latency_us
            queued = _beside_compute(layout, self.busy_bandwidth_gbps, queued_alpha, hook_s)
        return contended_timeline(buckets, lambda n: allreduce_seconds(n, layout) + hook_s,
                                  self.steal_us_per_mb * 1e-12, busy, queued, wait)


def _beside_compute(layout: Layout, bandwidth_gbps: float, latency_us: float, hook: float) -> Callable[[float], float]:
    """One bucket's all-reduce beside compute: the node's link replaced by one of ``bandwidth_gbps`` and
    ``latency_us`` (between nodes the network's own), plus the hook."""
    link = Link("beside compute", bandwidth_gbps, latency_us, "all-reduce beside compute")
    shared = replace(layout, intra=link, inter=link if layout.nodes == 1 else layout.inter)
    return lambda n: allreduce_seconds(n, shared) + hook


def contended_timeline(buckets: list[tuple[float, int]], seconds: Callable[[float], float],
                       steal_s_per_byte: float = 0.0, busy_seconds: Callable[[float], float] | None = None,
                       queued_seconds: Callable[[float], float] | None = None, wait: float = 0.0) -> SyncTimeline:
    """``ddptrain.plan.whatif.overlap.sync_timeline`` for ranks that share cores with their collectives (gloo on CPU).

    Each all-reduce takes ``seconds(bytes)`` on an idle host, ``busy_seconds(bytes)`` beside compute when it
    starts on an idle queue (its latency includes waking the collective's thread on a core busy with compute)
    and ``queued_seconds(bytes)`` beside compute when it was ready before the previous one finished (that thread
    is awake; defaults: the idle time, then the busy time), and takes ``steal_s_per_byte`` seconds of compute per
    byte it reduces beside compute (its reduction and copies on the cores: a latency-bound small all-reduce takes
    little, however long it is in flight). Without the three it is ``sync_timeline``."""
    if not buckets:
        return SyncTimeline(0.0, 0.0, 0.0)
    length = max(lead for lead, _ in buckets)  # backward compute left when the first bucket is ready
    ready = [length - lead for lead, _ in buckets]  # in compute-seconds done since then
    left_total = [seconds(n) for _, n in buckets]
    left = list(left_total)  # idle-host seconds of all-reduce still to do, per bucket
    lone = left_total if busy_seconds is None else [busy_seconds(n) for _, n in buckets]
    queued = lone if queued_seconds is None else [queued_seconds(n) for _, n in buckets]
    busy = list(lone)  # beside compute, per bucket: lone until it is known to have queued
    reached: list[float] = []  # when this rank's compute made each bucket ready, in order
    now = done = comm = 0.0
    compute_end = 0.0 if length <= 0 else None
    i = 0
    while i < len(buckets):
        while len(reached) < len(buckets) and done >= ready[len(reached)]:
            reached.append(now)
        computing = compute_end is None
        gate = reached[i] + wait if i < len(reached) else float("inf")  # every rank's bucket i is ready
        active = now >= gate
        comm_rate = (left_total[i] / busy[i] if busy[i] > 0 else 1.0) if computing else 1.0
        # the compute this collective takes, spread over its time beside compute (at most all of it)
        stolen = min(1.0, steal_s_per_byte * buckets[i][1] / busy[i]) if busy[i] > 0 else 0.0
        compute_rate = (1.0 - stolen) if active else 1.0
        target = ready[len(reached)] if len(reached) < len(buckets) else length  # the next readiness or the end
        to_target = (target - done) / compute_rate if computing and compute_rate > 0 else float("inf")
        to_gate = gate - now if not active else float("inf")
        to_finish = left[i] / comm_rate if active else float("inf")
        dt = min(to_target, to_gate, to_finish)
        now += dt
        if active:
            comm += dt
            left[i] -= dt * comm_rate
        if computing:
            done = target if to_target <= dt else done + dt * compute_rate
            if done >= length:
                compute_end = now
        if active and to_finish <= dt:
            i += 1
            if i < len(buckets) and done >= ready[i]:  # ready while bucket i-1 was in flight: its thread is awake
                busy[i] = queued[i]
    if compute_end is None:  # every all-reduce finished before backward did
        compute_end = now + (length - done)
    return SyncTimeline(max(0.0, now - compute_end), comm, compute_end - length)


class _Kernel:
    """A fixed amount of training-like compute: forward and backward of a 3-layer MLP on a fixed batch."""

    def __init__(self, width: int = 512, batch: int = 256) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, width, generator=gen)
        self.layers = [torch.randn(width, width, generator=gen, requires_grad=True) for _ in range(3)]

    def __call__(self) -> None:
        h = self.x
        for w in self.layers:
            h = torch.nn.functional.gelu(h @ w)
        h.square().mean().backward()

    def timed(self, calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            self()
        return time.perf_counter() - start


def measure_host(calls: int = 8, repeats: int = 7, sizes: tuple[int, int] = (64 * 2**10, 4 * 2**20)) -> HostFit:
    """``repeats`` rounds of each measurement on the default group (a collective: every rank calls it).

    ``calls`` kernel calls make one unit of compute (tens of ms on a CPU core), and the skew is also read after
    ``4 x calls``; all-reduces of ``sizes`` bytes (a small DDP bucket and a large one) run while the kernel
    runs, for the busy link and the steal (from the large one: the most bytes per reading).
    """
    kernel, rank = _Kernel(), dist.get_rank()
    kernel.timed(2)  # warm-up: allocations, thread pools
    flag, bufs = torch.zeros(1), [torch.zeros(n // 4) for n in sizes]
    for buf in bufs:
        dist.all_reduce(buf)
    tiny = _tiny_collective_s(flag)
    alone, together, steal, long_units, waits, long_waits = [], [], [], [], [], []
    busy: list[list[float]] = [[] for _ in sizes]
    queued: list[float] = []
    for _ in range(repeats):
        for r in range(dist.get_world_size()):  # each rank alone in turn, the others parked in a collective
            dist.barrier()
            seconds = kernel.timed(calls) if r == rank else 0.0
            dist.barrier()
            if r == rank:
                alone.append(seconds)
        dist.barrier()
        seconds = kernel.timed(calls)
        waits.append(max(0.0, _waited(flag) - tiny))
        together.append(seconds)
        dist.barrier()
        long_units.append(kernel.timed(4 * calls))
        long_waits.append(max(0.0, _waited(flag) - tiny))
        for buf, times in zip(bufs, busy, strict=True):
            dist.barrier()
            in_flight, done, computing = _overlapped(buf, kernel)
            times.append(in_flight)
        dist.barrier()
        queued.append(_queued(bufs[0], kernel))
        if done:  # from the large one; no kernel call started before it finished: no reading
            steal.append(max(0.0, computing - done * (seconds / calls)) / sizes[-1])
    world = dist.get_world_size()
    alpha, bandwidth = _busy_link(sizes, [_mean_over_ranks(t) for t in busy], world)
    hops = 2 * (world - 1)  # a ring all-reduce: its bytes' share on the busy bandwidth, the rest is α per hop
    bytes_s = hops / world * sizes[0] / (bandwidth * 1e9)
    queued_alpha = max(0.0, _mean_over_ranks(queued) - bytes_s) / hops * 1e6
    short, long = statistics.median(together), statistics.median(long_units)
    skew, skew_us = skew_terms(short, long, _mean_over_ranks(waits), _mean_over_ranks(long_waits))
    return HostFit(max(1.0, short / statistics.median(alone)), statistics.median(steal) * 1e12 if steal else 0.0,
                   alpha, bandwidth, skew, queued_alpha, skew_us)


def skew_terms(short: float, long: float, wait_short: float, wait_long: float) -> tuple[float, float]:
    """(``skew``, ``skew_us``): the line through the mean waits (over rounds and ranks) after a unit of compute of
    ``short`` and of ``long`` seconds: its slope per second of compute and its intercept in µs, neither negative.
    A rank late by the same time at every sync (the others wait that long, it waits nothing) raises both waits
    alike: the intercept takes it, the slope does not."""
    skew = max(0.0, (wait_long - wait_short) / (long - short)) if long > short else 0.0
    return skew, max(0.0, wait_short - skew * short) * 1e6


def _busy_link(sizes: tuple[int, int], seconds: list[float], world_size: int) -> tuple[float, float]:
    """(α µs, B GB/s) through the small and the large all-reduce's times. When wake-up noise makes the small one
    the slower, the bytes' share cannot be told apart: α from the small one, B from the large one's whole time."""
    (small, large), (t_small, t_large) = sizes, seconds
    if t_large > t_small:
        fit = fit_link([small, large], [t_small, t_large], world_size)
        return fit.latency_us, fit.bandwidth_gbps
    hops = 2 * (world_size - 1)
    return t_small / hops * 1e6, hops / world_size * large / t_large / 1e9


def _overlapped(buf: torch.Tensor, kernel: _Kernel) -> tuple[float, int, float]:
    """An all-reduce launched beside compute: (seconds from launch to its completion, kernel calls run until it
    completed, seconds those calls took)."""
    finished: list[float] = []
    start = time.perf_counter()
    work = dist.all_reduce(buf, async_op=True)
    work.get_future().then(lambda _: finished.append(time.perf_counter()))  # completion, not the next poll
    done = 0
    while not work.is_completed():
        kernel()
        done += 1
    computing = time.perf_counter() - start
    work.wait()
    while not finished:  # the callback runs on gloo's thread right after completion
        time.sleep(1e-4)
    return finished[0] - start, done, computing


def _queued(buf: torch.Tensor, kernel: _Kernel, count: int = 8) -> float:
    """``count`` all-reduces of ``buf`` launched back to back beside compute, as DDP launches its buckets: the
    mean time between completions, i.e. what each one after the first adds once the queue is awake."""
    bufs = [buf.clone() for _ in range(count)]
    finished: list[float] = []
    works = [dist.all_reduce(b, async_op=True) for b in bufs]
    for work in works:
        work.get_future().then(lambda _: finished.append(time.perf_counter()))
    while not all(work.is_completed() for work in works):
        kernel()
    for work in works:
        work.wait()
    while len(finished) < count:  # the callbacks run on gloo's thread right after completion
        time.sleep(1e-4)
    return (max(finished) - min(finished)) / (count - 1)


def _waited(flag: torch.Tensor) -> float:
    """Seconds in a one-element all-reduce: the wait for the slowest rank plus one tiny collective's latency."""
    start = time.perf_counter()
    dist.all_reduce(flag)
    return time.perf_counter() - start


def _mean_over_ranks(values: list[float]) -> float:
    """The mean of ``values`` over rounds and ranks: what every rank then predicts with."""
    total = torch.tensor([statistics.fmean(values)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _tiny_collective_s(flag: torch.Tensor, repeats: int = 20) -> float:
    """The latency of a one-element all-reduce when every rank arrives together: what is not skew."""
    return allreduce_median_s(flag, repeats)
