"""How sharing a host changes a rank's compute: measured on the real process group, for the what-if predictor.

A 1-rank run times compute on a host that one rank has to itself. At N ranks three things change that an α–β
fit of the all-reduce does not see, and each is measured here with one fixed compute kernel (an MLP's forward
and backward, the matmul-plus-elementwise mix of a transformer block):

- ``contention``: the kernel's time with every rank computing at once over its time on one rank alone. Ranks
  sharing CPU cores, memory bandwidth or a hypervisor's siblings slow each other; with one GPU per rank it is ~1.
- ``comm_steal``: the fraction of compute speed a rank loses while one of its collectives is in flight. On CPU
  gloo's threads reduce and copy on the same cores as the model; NCCL runs on its own stream: ~0 on GPUs.
- ``comm_stretch``: how much longer a collective takes while the rank computes than while it waits (the same
  shared cores, seen from the other side); ~1 on GPUs.
- ``skew``: how long a rank waits at a collective for the slowest rank, as a fraction of the compute since the
  last sync. Equal work finishes at different times when ranks are jostled; dedicated GPUs keep it small.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HostFit:
    """Measured host-side terms of N ranks; the defaults (a rank per dedicated device) change nothing."""

    contention: float = 1.0  # compute time, every rank computing at once / one rank alone
    comm_steal: float = 0.0  # fraction of compute speed lost while a collective is in flight
    comm_stretch: float = 1.0  # a collective's time while the rank computes / while it waits
    skew: float = 0.0  # wait for the slowest rank at a sync / compute since the previous sync

    def overrides(self) -> str:
        """The ``plan.*`` overrides that carry the fit to ``launch.dry_run=true plan.from_run=...``."""
        return (f"plan.contention={self.contention:.3f} plan.comm_steal={self.comm_steal:.3f} "
                f"plan.comm_stretch={self.comm_stretch:.3f} plan.skew={self.skew:.4f}")


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


def measure_host(calls: int = 8, repeats: int = 7, comm_bytes: int = 16 * 2**20) -> HostFit:
    """Median of ``repeats`` rounds of each measurement on the default group (a collective: every rank calls it).

    ``calls`` kernel calls make one unit of compute (tens of ms on a CPU core); ``comm_bytes`` is the all-reduce
    kept in flight while the kernel runs, to see what it takes from compute.
    """
    kernel, rank = _Kernel(), dist.get_rank()
    kernel.timed(2)  # warm-up: allocations, thread pools
    flag, buf = torch.zeros(1), torch.zeros(comm_bytes // 4)
    dist.all_reduce(buf)
    tiny = _tiny_collective_s(flag)
    alone, together, steal, skew, comm_alone, comm_busy = [], [], [], [], [], []
    for _ in range(repeats):
        for r in range(dist.get_world_size()):  # each rank alone in turn, the others parked in a collective
            dist.barrier()
            seconds = kernel.timed(calls) if r == rank else 0.0
            dist.barrier()
            if r == rank:
                alone.append(seconds)
        dist.barrier()
        seconds = kernel.timed(calls)
        start = time.perf_counter()
        dist.all_reduce(flag)  # its time is the wait for the slowest rank (plus one tiny collective's latency)
        wait = time.perf_counter() - start
        together.append(seconds)
        skew.append(max(0.0, wait - tiny) / seconds)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        comm_alone.append(time.perf_counter() - start)
        dist.barrier()
        work, start, done = dist.all_reduce(buf, async_op=True), time.perf_counter(), 0
        while not work.is_completed():  # compute as much as the collective's flight allows
            kernel()
            done += 1
        in_flight = time.perf_counter() - start
        work.wait()
        comm_busy.append(in_flight)
        steal.append(max(0.0, 1.0 - done * (seconds / calls) / in_flight))
    # skew: the mean wait over rounds and ranks (a step pays the mean; waits are mostly short, sometimes long)
    mean_skew = torch.tensor([statistics.fmean(skew)])
    dist.all_reduce(mean_skew)
    median = statistics.median
    return HostFit(max(1.0, median(together) / median(alone)), median(steal),
                   max(1.0, median(comm_busy) / median(comm_alone)), float(mean_skew) / dist.get_world_size())


def _tiny_collective_s(flag: torch.Tensor, repeats: int = 20) -> float:
    """The latency of a one-element all-reduce when every rank arrives together: what is not skew."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flag)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
