"""What-if predictor: a measured run's step time, carried to other world sizes and node layouts.

Calibration comes from a run's ``summary.json`` (compute per phase, the batch, and each gradient bucket's
readiness and size). Links are α–β models: the planner's presets, or a fit of the real process group; the host
terms (``HostFit``) are measured by ``scripts/bench_collectives.py`` on the same group. For N ranks:

- weak scaling: every rank keeps the calibration run's work per step (micro batch x grad_accum), so the global
  batch grows with N; compute per rank is as measured, times ``contention`` (ranks sharing a host's cores);
- each bucket's all-reduce (α–β plus the per-bucket hook cost) starts when the bucket is ready on every rank
  and the previous all-reduce has finished, so it can only hide behind the backward compute that follows it;
  where collectives share cores with compute, each takes ``steal_us_per_mb`` of compute per MB it reduces
  while backward runs, and they run on the busy link (``busy_latency_us``/``busy_bandwidth_gbps``) until
  backward's compute ends; the busy α (waking the collective's thread on a busy core) only for one that starts
  on an idle queue: one queued while the previous is in flight pays ``queued_latency_us`` (measured; None: the
  idle link's α) on the busy bandwidth;
- ranks drift apart over the compute since the previous sync point (DDP's buffer broadcast at the start of the
  last micro-batch's forward): the mean wait for the slowest rank is ``skew_us + skew x`` that compute, fitted
  at two unit lengths of compute. With one late rank, each of the others sees every all-reduce start that much
  later (N/(N-1) x the mean wait), shifting the start, not adding to the tail: the exposed time and the steal
  are the mean over the waiting ranks and the late one.

On GPUs (a device per rank, NCCL on its own stream) the host terms are ~(1, 0, no busy link, small): the
defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ddptrain.comm.hostfit import HostFit
from ddptrain.data.batch import BatchShape
from ddptrain.plan.calibration import Calibration
from ddptrain.plan.layout import Layout, allreduce_seconds
from ddptrain.plan.overlap import sync_timeline
from ddptrain.plan.planner import Link


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    batch: BatchShape
    compute_s: float  # measured compute x contention, plus what in-flight collectives took from backward
    exposed_s: float  # the sync past the end of backward's compute: waiting for the slowest rank + the tail
    comm_s: float  # time with an all-reduce in flight
    terms: dict[str, float]  # seconds per step each modelled effect adds, for the record

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch.tokens_per_step / self.step_s


def predict(cal: Calibration, layout: Layout, host: HostFit | None = None) -> Prediction:
    """The step of ``cal``'s run on ``layout``, each rank doing the work per step that it did (weak scaling)."""
    per_rank = cal.micro_batch_size * cal.grad_accum
    batch = BatchShape.derive(per_rank * layout.world_size, cal.micro_batch_size, cal.grad_accum, layout.world_size,
                             cal.seq_len)
    measured = cal.micro_step_s * batch.grad_accum + cal.optimizer_s
    if layout.world_size == 1:
        return Prediction(layout, batch, measured, 0.0, 0.0, {})
    host = host or HostFit()
    compute = measured * host.contention
    buckets = [(lead * host.contention, n) for lead, n in cal.buckets]
    busy = queued = None
    if host.busy_bandwidth_gbps:
        busy = _beside_compute(layout, host.busy_bandwidth_gbps, host.busy_latency_us or 0.0, cal.hook_s)
        queued_alpha = layout.intra.latency_us if host.queued_latency_us is None else host.queued_latency_us
        queued = _beside_compute(layout, host.busy_bandwidth_gbps, queued_alpha, cal.hook_s)
    idle = lambda n: allreduce_seconds(n, layout) + cal.hook_s  # noqa: E731
    steal = host.steal_us_per_mb * 1e-12
    wait = max(0.0, host.skew_us * 1e-6 + host.skew * cal.micro_step_s * host.contention)  # mean over ranks
    peer_lag = wait * layout.world_size / (layout.world_size - 1)  # one late rank; the others wait for it
    late = sync_timeline(buckets, idle, steal, busy, queued)
    waiting = sync_timeline(buckets, idle, steal, busy, queued, wait=peer_lag)
    mean = lambda f: (f(late) + (layout.world_size - 1) * f(waiting)) / layout.world_size  # noqa: E731
    exposed, stolen = mean(lambda t: t.exposed_s), mean(lambda t: t.stolen_s)
    lone = sync_timeline(buckets, idle, steal, busy)  # every one paying the wake-up, for the record
    terms = {"contention_s": compute - measured, "steal_s": stolen, "skew_s": exposed - late.exposed_s,
             "hook_s": cal.hook_s * len(buckets), "tail_s": late.exposed_s,
             "queued_s": late.exposed_s - lone.exposed_s}
    return Prediction(layout, batch, compute + stolen, exposed, late.comm_s, terms)


def _beside_compute(layout: Layout, bandwidth_gbps: float, latency_us: float, hook: float) -> Callable[[float], float]:
    """One bucket's all-reduce beside compute: the node's link replaced by one of ``bandwidth_gbps`` and
    ``latency_us`` (between nodes the network's own), plus the hook."""
    link = Link("beside compute", bandwidth_gbps, latency_us, "all-reduce beside compute")
    shared = replace(layout, intra=link, inter=link if layout.nodes == 1 else layout.inter)
    return lambda n: allreduce_seconds(n, shared) + hook
