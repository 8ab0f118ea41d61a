"""Gradient compression as DDP communication hooks (fp16, bf16, PowerSGD, top-k), each counting the bytes it sends.

``register_compression`` installs the hook that ``parallel.compression`` names and returns its ``CompressionState``: the
``CommMeter`` that the training loop reads, and resets, after every optimizer step, and the hook's error-feedback
state, which a skipped (non-finite) step must not leave behind.
"""

# No ``from __future__ import annotations`` here: DDP compares a hook's annotations with the real
# ``dist.GradBucket`` and ``Future[Tensor]`` types, and string annotations fail that check.

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from ddptrain.comm.accounting import in_flight_seconds
from ddptrain.comm.clock import CommClock, Span
from ddptrain.config.schema import ParallelConfig
from ddptrain.kernels import TorchKernels, select_kernels
from ddptrain.telemetry.comm import SyncSample


@dataclass
class CommMeter:
    """Gradient payload bytes this rank hands to collectives since the last ``reset()`` (one optimizer step).

    Payload is the size of the tensors this rank passes in: an all-reduce of D bytes counts D; TopK's all-gather
    counts this rank's own k values + k indices (it receives world_size - 1 such payloads). ``uncompressed_bytes``
    is the payload of a plain all-reduce of the same buckets in their own dtype (fp32 for fp32 parameters).
    Hooks fire once per bucket per synchronized backward and not under ``no_sync``, so a step counts exactly
    its gradient syncs. Payload is not link traffic: per rank a ring all-reduce moves 2(W-1)/W·D and an
    all-gather of P moves (W-1)·P, so on W ranks TopK's link traffic ratio is W/2 times its payload ratio.
    """

    clock: CommClock  # host clock on gloo, CUDA events on CUDA, none where works complete at enqueue
    comm_bytes: int = 0
    uncompressed_bytes: int = 0
    # what the same buckets send with the compression in effect: comm_bytes, except while PowerSGD warms up
    # (its first parallel.powersgd_start_iter - 1 steps are plain all-reduces)
    steady_bytes: int = 0
    # Each bucket's (hook call, completion of its future) on ``clock``. On CUDA the completion is an event
    # recorded in the future's callback, whose stream waits for the collective, so it marks the device's end.
    spans: list[Span] = field(default_factory=list)
    # (host clock, bucket bytes) at each hook call: when each bucket became ready, for the what-if predictor
    launches: list[tuple[float, int]] = field(default_factory=list)

    def record(self, sent_bytes: int, bucket: torch.Tensor, steady_bytes: int | None = None) -> None:
        """Charge one bucket's sync: what was sent, what an uncompressed all-reduce of ``bucket`` would send, and
        (``steady_bytes``, where it differs from what was sent) what it sends once the compression is in effect."""
        self.comm_bytes += sent_bytes
        self.uncompressed_bytes += bucket.numel() * bucket.element_size()
        self.steady_bytes += sent_bytes if steady_bytes is None else steady_bytes

    @property
    def ratio(self) -> float:
        """Sent over uncompressed payload; 1.0 before any sync."""
        return self.comm_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 1.0

    def reset(self) -> None:
        self.comm_bytes = 0
        self.uncompressed_bytes = 0
        self.steady_bytes = 0
        self.spans.clear()
        self.launches.clear()

    def timing(self) -> tuple[float | None, float | None]:
        """(time with a gradient collective in flight, exposed time), or (None, None) where the clock cannot see.

        Exposed is the time from the last bucket's launch (the end of backward compute, as DDP sees it) to the end
        of the last collective. On CUDA the events must have completed: read after the step's synchronization.
        """
        spans = self.clock.resolve(self.spans)
        if spans is None:
            return None, None
        if not spans:
            return 0.0, 0.0
        exposed = max(end for _, end in spans) - max(start for start, _ in spans)
        return in_flight_seconds(spans), max(0.0, exposed)

    def take_sample(self, world_size: int, sampled: bool) -> tuple[SyncSample | None, float | None]:
        """The step's payload, spans and bucket launches as a sample (``sampled`` steps only) and its ratio; resets."""
        sample = None
        if sampled:
            comm_s, exposed_s = self.timing()
            last = max((t for t, _ in self.launches), default=None)
            buckets = tuple((last - t, n) for t, n in self.launches) if last is not None else ()
            steady = self.steady_bytes if self.steady_bytes != self.comm_bytes else None
            sample = SyncSample(self.comm_bytes, comm_s, exposed_s, buckets, steady_bytes=steady)
        ratio = self.ratio
        self.reset()
        return sample, ratio


def _timed(hook: Callable[[Any, dist.GradBucket], Future[torch.Tensor]]) -> Callable[..., Future[torch.Tensor]]:
    """The same hook, with the span from its call to its future's completion recorded on the meter's clock."""

    def timed(state: _State, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        start = state.meter.clock.mark()
        state.meter.launches.append((time.perf_counter(), bucket.buffer().numel() * bucket.buffer().element_size()))

        def done(fut: Future[torch.Tensor]) -> torch.Tensor:
            state.meter.spans.append((start, state.meter.clock.mark()))
            return fut.value()

        return hook(state, bucket).then(done)

    return timed


@dataclass
class _State:
    """What every hook needs: the group it averages over (None: the default group) and the meter it charges."""

    process_group: dist.ProcessGroup | None
    meter: CommMeter


@dataclass
class _CastState(_State):
    dtype: torch.dtype
    kernels: TorchKernels  # who casts: fused Triton kernels or torch


@dataclass
class _TopKState(_State):
    ratio: float
    error_feedback: bool
    # Keyed by parameter, not bucket: DDP reorders its buckets after the first step.
    residuals: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)

    def discard_if(self, nonfinite: torch.Tensor) -> None:
        """Zero every residual when the step was non-finite (on the device: no host read).

        A non-finite gradient leaves a non-finite residual, which every later step would add back: one bad step
        would poison the run for good. ``nonfinite`` is the step's verdict, the same on every rank, so every rank
        drops its residuals together, also those whose own residuals are finite.
        """
        for residual in self.residuals.values():
            residual.masked_fill_(nonfinite, 0.0)


@dataclass
class _PowerSGDState(_State):
    powersgd: PowerSGDState

    def discard_if(self, nonfinite: torch.Tensor) -> None:
        """Forget the errors and the warm-start matrices after a non-finite step; the next compressed step starts
        them afresh (zero errors, new random Q from PowerSGD's own generator, which draws alike on every rank).

        A host read of the verdict (a sync point), once a step, only while PowerSGD keeps state: its Q matrix, not
        only its error, turns non-finite, and a fresh Q comes from the host-side generator. torch's hook already
        synchronizes with the device once per bucket on CUDA, so the step was not free of host waits before.
        """
        powersgd = self.powersgd
        if not (powersgd.error_dict or powersgd.q_memory_dict) or not bool(nonfinite):
            return
        powersgd.error_dict.clear()
        powersgd.p_memory_dict.clear()
        powersgd.q_memory_dict.clear()


class ErrorFeedback(Protocol):
    """A hook's state carried from step to step (what top-k and PowerSGD did not send yet)."""

    def discard_if(self, nonfinite: torch.Tensor) -> None:
        """Drop the state when ``nonfinite`` (a 0-dim bool tensor, the step's verdict alike on every rank)."""


@dataclass
class CompressionState:
    """What ``register_compression`` installed: the meter it charges and the state a skipped step must drop."""

    meter: CommMeter
    feedback: ErrorFeedback | None = None  # None: the hook keeps nothing between steps (none, fp16, bf16)

    def step_done(self, nonfinite: torch.Tensor) -> None:
        """After the update (taken or skipped on ``nonfinite``): drop the error feedback of a non-finite step."""
        if self.feedback is not None:
            self.feedback.discard_if(nonfinite)


def _allreduce_hook(state: _State, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP's own averaging, metered so that an uncompressed run logs comm_bytes too."""
    buffer = bucket.buffer()
    state.meter.record(buffer.numel() * buffer.element_size(), buffer)
    return default_hooks.allreduce_hook(state.process_group, bucket)


def _cast_hook(state: _CastState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average in a narrower dtype and cast back into the bucket: the division by the world size is fused into the
    downcast (divide first: no overflow), one pass each way.

    Ours rather than torch's: its bf16 hook refuses CPU builds although gloo reduces bf16 fine.
    """
    buffer = bucket.buffer()
    compressed = torch.empty_like(buffer, dtype=state.dtype)
    state.kernels.cast_(compressed, buffer, 1.0 / dist.get_world_size(state.process_group))
    state.meter.record(compressed.numel() * compressed.element_size(), buffer)
    fut = dist.all_reduce(compressed, group=state.process_group, async_op=True).get_future()

    def decompress(f: Future[list[torch.Tensor]]) -> torch.Tensor:
        state.kernels.cast_(buffer, f.value()[0])
        return buffer

    return fut.then(decompress)


def _topk_hook(state: _TopKState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Send this rank's ``ratio`` largest-magnitude entries (values + indices); average what all ranks sent.

    With error feedback the entries not sent stay behind as a residual added to the next step's gradient.
    """
    buffer = bucket.buffer()
    params, grads = bucket.parameters(), bucket.gradients()  # grads are views into buffer
    if state.error_feedback:
        for param, grad in zip(params, grads, strict=True):
            if param in state.residuals:
                grad.add_(state.residuals[param])
    k = math.ceil(state.ratio * buffer.numel())  # the same on every rank, so one fixed-size all-gather fits
    index = buffer.abs().topk(k, sorted=False).indices
    values = buffer[index]
    if state.error_feedback:
        buffer[index] = 0
        for param, grad in zip(params, grads, strict=True):
            state.residuals[param] = grad.clone()
    index = index.to(torch.int32 if buffer.numel() < 2**31 else torch.int64)
    payload = torch.cat([values.view(torch.uint8), index.view(torch.uint8)])  # one collective, not two
    state.meter.record(payload.numel(), buffer)
    world_size = dist.get_world_size(state.process_group)
    gathered = payload.new_empty(world_size * payload.numel())
    fut = dist.all_gather_single(gathered, payload, group=state.process_group, async_op=True).get_future()

    def decompress(_: Future[list[torch.Tensor]]) -> torch.Tensor:
        rows, split = gathered.view(world_size, -1), values.numel() * values.element_size()
        all_values = rows[:, :split].contiguous().view(values.dtype)
        # a copy of its own: on one rank the slice is already contiguous, at a byte offset of 4 x k, which an
        # int64 view (a bucket of 2**31 elements or more) cannot take when k is odd
        all_index = rows[:, split:].clone(memory_format=torch.contiguous_format).view(index.dtype)
        return sum_in_rank_order(buffer, all_values, all_index).div_(world_size)

    return fut.then(decompress)


def sum_in_rank_order(out: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out`` zeroed, then rank 0's ``values[0]`` added at ``index[0]``, then rank 1's, and so on: the same bits
    on every rank, in every run, on any device.

    One scatter-add of every rank's entries at once (``index_add_``) adds where indices collide in whatever order
    CUDA's atomics land, which torch documents as nondeterministic: replicas would round the same gathered values
    differently, and DDP never re-broadcasts parameters, so they would drift apart for good. Within one rank the
    top-k indices are distinct, so each rank's turn is a gather, an add and a plain (non-accumulating) index_put_
    with no collisions: no scatter-add at all, and no host sync (3 kernels of k entries per rank).
    """
    out.zero_()
    for rank_values, rank_index in zip(values, index, strict=True):
        out[rank_index] = out[rank_index] + rank_values
    return out


def _powersgd_hook(state: _PowerSGDState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """torch's PowerSGD, charged by torch's own tally: (n+m)·r elements per compressed matrix, other tensors whole."""
    powersgd = state.powersgd
    buffer = bucket.buffer()
    compressing = powersgd.iter >= powersgd.start_powerSGD_iter  # before that: a plain all-reduce
    before = powersgd.compression_stats()[2]
    fut = powerSGD_hook(powersgd, bucket)
    if compressing:
        elements = powersgd.compression_stats()[2] - before
        state.meter.record(elements * buffer.element_size(), buffer)
    else:  # the start-up line tells what a step will send, not only what the warm-up steps do
        steady = powersgd_elements(powersgd, bucket.gradients()) * buffer.element_size()
        state.meter.record(buffer.numel() * buffer.element_size(), buffer, steady_bytes=steady)
    return fut


def powersgd_elements(powersgd: PowerSGDState, gradients: list[torch.Tensor]) -> int:
    """The elements torch's PowerSGD hook sends for these gradients once it compresses, by its own rule (its
    ``compression_stats`` tally): each gradient viewed as a matrix of ``shape[0]`` rows; one worth compressing
    (``min_compression_rate`` times its (n+m)·r factors is still smaller) sends (n+m)·r, any other its n·m.
    tests/test_compression.py checks the figure against the tally of a compressed step."""
    total = 0
    for grad in gradients:
        n = grad.shape[0]
        m = grad.numel() // n
        rank = min(n, m, powersgd.matrix_approximation_rank)
        compressed = (n + m) * rank
        total += compressed if compressed * powersgd.min_compression_rate < n * m else n * m
    return total


def register_compression(
    model: DistributedDataParallel, cfg: ParallelConfig, process_group: dist.ProcessGroup | None = None
) -> CompressionState:
    """Install ``cfg.compression``'s hook on ``model`` (before its first backward); return the meter it charges and
    its error-feedback state.

    Every choice, ``none`` included, is metered, so the training loop can always log comm_bytes.
    PowerSGD always warm-starts (torch's recommendation); ``error_feedback`` applies to powersgd and topk.
    """
    device = next(model.module.parameters()).device
    meter = CommMeter(CommClock.for_collectives(device, process_group))
    match cfg.compression:
        case "none":
            model.register_comm_hook(_State(process_group, meter), _timed(_allreduce_hook))
            return CompressionState(meter)
        case "fp16" | "bf16":
            dtype = torch.float16 if cfg.compression == "fp16" else torch.bfloat16
            kernels = select_kernels(cfg.kernels, next(model.parameters()).device)
            model.register_comm_hook(_CastState(process_group, meter, dtype, kernels), _timed(_cast_hook))
            return CompressionState(meter)
        case "powersgd":
            powersgd = PowerSGDState(
                process_group,
                matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=cfg.powersgd_start_iter,
                use_error_feedback=cfg.error_feedback,
                warm_start=True,
            )
            state = _PowerSGDState(process_group, meter, powersgd)
            model.register_comm_hook(state, _timed(_powersgd_hook))
            return CompressionState(meter, state)
        case "topk":
            topk = _TopKState(process_group, meter, cfg.topk_ratio, cfg.error_feedback)
            model.register_comm_hook(topk, _timed(_topk_hook))
            return CompressionState(meter, topk)
    raise ValueError(f"parallel.compression={cfg.compression!r}: expected none, fp16, bf16, powersgd or topk")
