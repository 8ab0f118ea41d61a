"""How sharing a host changes a rank's compute: measured on the real process group, for the what-if predictor.

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
  dedicated GPUs keep it small.

Means, not medians, for the times that a step pays in full however they are spread (waits, busy all-reduces,
whose times on a busy CPU are mostly short and sometimes a scheduler slice long).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddptrain.plan.linkfit import allreduce_median_s, fit_link

if TYPE_CHECKING:
    from ddptrain.config.schema import PlanConfig


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

    @classmethod
    def from_plan(cls, plan: PlanConfig, *, compute_measured_together: bool = False) -> HostFit:
        """The host terms a config carries (``plan.*``). ``compute_measured_together``: the compute was timed with
        every rank running beside the others (a run predicting itself), so contention and steal are already in it."""
        if compute_measured_together:
            return cls(1.0, 0.0, plan.busy_latency_us, plan.busy_bandwidth_gbps, plan.skew, plan.queued_latency_us,
                       plan.skew_us)
        return cls(plan.contention, plan.steal_us_per_mb, plan.busy_latency_us, plan.busy_bandwidth_gbps, plan.skew,
                   plan.queued_latency_us, plan.skew_us)

    def overrides(self) -> str:
        """The ``plan.*`` overrides that carry the fit to ``launch.dry_run=true plan.from_run=...``."""
        busy = "" if self.busy_bandwidth_gbps is None else (
            f" plan.busy_latency_us={self.busy_latency_us:.1f} plan.busy_bandwidth_gbps={self.busy_bandwidth_gbps:.4f}")
        if self.queued_latency_us is not None:
            busy += f" plan.queued_latency_us={self.queued_latency_us:.1f}"
        return (f"plan.contention={self.contention:.3f} plan.steal_us_per_mb={self.steal_us_per_mb:.1f} "
                f"plan.skew={self.skew:.4f} plan.skew_us={self.skew_us:.1f}{busy}")


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
    wait_short, wait_long = _mean_over_ranks(waits), _mean_over_ranks(long_waits)
    skew = max(0.0, (wait_long - wait_short) / (long - short)) if long > short else 0.0
    return HostFit(max(1.0, short / statistics.median(alone)), statistics.median(steal) * 1e12 if steal else 0.0,
                   alpha, bandwidth, skew, queued_alpha, max(0.0, wait_short - skew * short) * 1e6)


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
