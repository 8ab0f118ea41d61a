"""What-if predictor: a measured run's step time, carried to other world sizes and node layouts.

Calibration comes from a run's ``summary.json`` (compute per phase, the batch, each gradient bucket's readiness
and size, and the rank skew its straggler telemetry measured). Links are α–β models: the planner's presets, or a
fit of the real process group (``scripts/bench_collectives.py``). For N ranks:

- weak scaling: every rank keeps the calibration run's work per step (micro batch x grad_accum), so the global
  batch grows with N; compute per rank is as measured;
- each bucket's all-reduce (α–β plus the per-bucket hook cost) starts when the bucket is ready on every rank
  and the previous all-reduce has finished, so it can only hide behind the backward compute that follows it;
- ranks drift apart over the compute since the previous sync point (DDP's buffer broadcast at the start of the
  last micro-batch's forward): the mean wait for the slowest rank is the calibration's ``skew`` x that compute
  (the share of their busy time the calibrating run's ranks waited for the slowest one). With one late rank,
  each of the others sees every all-reduce start that much later (N/(N-1) x the mean wait), shifting the start,
  not adding to the tail: the exposed time is the mean over the waiting ranks and the late one.

Ranks that share a host's CPU cores with each other and with gloo's threads change more than this (compute
contention, collectives slowed and stealing compute beside it, extra waits): ``HostTerms`` carries those. Only the
CPU validation script builds one (``scripts/cpu_host_fit.py``); without it (as on GPUs) they change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ddptrain.data.batch import BatchShape
from ddptrain.plan.whatif.calibration import Calibration
from ddptrain.plan.whatif.layout import Layout, allreduce_seconds
from ddptrain.plan.whatif.overlap import SyncTimeline, sync_timeline


class HostTerms(Protocol):
    """What ranks sharing one host's cores change in a step beyond the α–β link and the measured compute."""

    @property
    def contention(self) -> float:
        """Compute time with every rank computing at once over one rank's alone."""
        ...

    def wait_s(self, compute_s: float) -> float:
        """The mean wait for the slowest rank, beyond the calibration's own skew, after ``compute_s`` of compute."""
        ...

    def sync_timeline(self, buckets: list[tuple[float, int]], layout: Layout, hook_s: float,
                      wait: float) -> SyncTimeline:
        """The gradient sync of ``buckets`` on ``layout`` (``overlap.sync_timeline``'s terms) with the collectives
        sharing cores with compute."""
        ...


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    batch: BatchShape
    compute_s: float  # measured compute (x the host's contention), plus what in-flight collectives took from it
    exposed_s: float  # the sync past the end of backward's compute: waiting for the slowest rank + the tail
    comm_s: float  # time with an all-reduce in flight
    terms: dict[str, float]  # seconds per step each modelled effect adds, for the record
    sequence_tokens: float  # real tokens per sequence (the calibrating run's; seq_len for fixed blocks)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        """Real tokens per second: prompt/completion rows count their own tokens, not seq_len each."""
        return self.batch.global_batch_size * self.sequence_tokens / self.step_s


def predict(cal: Calibration, layout: Layout, host: HostTerms | None = None) -> Prediction:
    """The step of ``cal``'s run on ``layout``, each rank doing the work per step that it did (weak scaling);
    ``host``: the terms of ranks sharing a CPU host (None: a device per rank, as on GPUs)."""
    per_rank = cal.micro_batch_size * cal.grad_accum
    batch = BatchShape.derive(per_rank * layout.world_size, cal.micro_batch_size, cal.grad_accum, layout.world_size,
                             cal.seq_len)
    measured = cal.micro_step_s * batch.grad_accum + cal.optimizer_s
    if layout.world_size == 1:
        return Prediction(layout, batch, measured, 0.0, 0.0, {}, cal.sequence_tokens)
    contention = 1.0 if host is None else host.contention
    compute = measured * contention
    buckets = [(lead * contention, n) for lead, n in cal.buckets]
    since_sync = cal.micro_step_s * contention
    wait = max(0.0, cal.skew * since_sync + (0.0 if host is None else host.wait_s(since_sync)))  # mean over ranks
    peer_lag = wait * layout.world_size / (layout.world_size - 1)  # one late rank; the others wait for it

    def timeline(lag: float) -> SyncTimeline:
        if host is not None:
            return host.sync_timeline(buckets, layout, cal.hook_s, lag)
        return sync_timeline(buckets, lambda n: allreduce_seconds(n, layout) + cal.hook_s, lag)

    late, waiting = timeline(0.0), timeline(peer_lag)
    mean = lambda f: (f(late) + (layout.world_size - 1) * f(waiting)) / layout.world_size  # noqa: E731
    exposed, stolen = mean(lambda t: t.exposed_s), mean(lambda t: t.stolen_s)
    terms = {"contention_s": compute - measured, "steal_s": stolen, "skew_s": exposed - late.exposed_s,
             "hook_s": cal.hook_s * len(buckets), "tail_s": late.exposed_s}
    return Prediction(layout, batch, compute + stolen, exposed, late.comm_s, terms, cal.sequence_tokens)
