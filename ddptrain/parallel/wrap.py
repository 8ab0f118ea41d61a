"""wrap_model(model, cfg): the data-parallel strategy chosen by ``parallel.*`` and how to skip gradient sync."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ddptrain.comm.clock import CommClock
from ddptrain.config.schema import ParallelConfig
from ddptrain.parallel.compression import CompressionState, register_compression
from ddptrain.parallel.zero import fsdp_sync, shard_model
from ddptrain.telemetry.comm import SyncMeter, SyncSample, payload_from_link_bytes

if TYPE_CHECKING:
    from ddptrain.engines.base import DataParallelEngine

log = logging.getLogger(__name__)


@dataclass
class Wrapped:
    """What the training loop needs from a strategy."""

    outer: torch.nn.Module  # call this for forward: DDP, a from-scratch engine, the FSDP2-sharded model, or the
    # bare model (a wrapper's own ``.module``, as torch DDP's, is the model it wraps)
    model: torch.nn.Module  # the underlying model (parameters, evaluation, export)
    maybe_sync: Callable[[bool], AbstractContextManager]  # ctx(sync): skip gradient sync when sync is False
    meter: SyncMeter | None  # what measures gradient sync: torch DDP's hook or our engine's reducer
    strategy: str  # what wraps the model, for the log and summary.json ("none" for the bare model)
    compression: CompressionState | None = None  # torch DDP's communication hook: its meter and error-feedback state

    def step_done(self, nonfinite: torch.Tensor) -> None:
        """After the update: a non-finite step's error feedback is dropped on every rank (compression hooks)."""
        if self.compression is not None:
            self.compression.step_done(nonfinite)

    def take_sync_sample(self, world_size: int, sampled: bool) -> tuple[SyncSample | None, float | None]:
        """The last step's gradient sync (bytes, time in flight, exposed time) and compression ratio; resets.

        Only a ``sampled`` step (one the timer synchronized) yields a sample: CUDA events are readable only then.
        torch DDP: from the metered hook's spans. Our engines: from their reducer's stats. FSDP2 stages and the
        bare model: nothing (None). Times are None where the backend's clock cannot see its collectives.
        """
        return self.meter.take_sample(world_size, sampled) if self.meter is not None else (None, None)

    def comm_clock(self) -> CommClock | None:
        """The clock gradient collectives are timed on (None: this strategy's sync is not measured)."""
        return self.meter.clock if self.meter is not None else None


@dataclass(frozen=True)
class EngineMeter:
    """Our engines' gradient sync as a ``SyncMeter``: the reducer keeps a fresh ``CommStats`` per synchronised
    backward, read here after the step. Link bytes are converted back to payload; engines do not compress."""

    engine: DataParallelEngine

    @property
    def clock(self) -> CommClock:
        return self.engine.comm_stats.clock

    def take_sample(self, world_size: int, sampled: bool) -> tuple[SyncSample | None, float | None]:
        if not sampled:
            return None, None
        stats = self.engine.comm_stats
        payload = payload_from_link_bytes(stats.bytes_sent, world_size)
        return SyncSample(payload, stats.in_flight_s, stats.exposed_s), None


def wrap_model(
    model: torch.nn.Module, cfg: ParallelConfig, device: torch.device, precision: str = "auto", ranks_per_node: int = 1,
    timeout: timedelta | None = None,
) -> Wrapped:
    """The bare model at world size 1; else torch DDP (stages 0-1, with its knobs and a compression hook),
    FSDP2 (stages 2-3, in ``precision`` resolved for ``device``), or our own engines. The choice is logged, and
    so is a backend whose clock cannot time gradient sync (those figures are then absent). ``ranks_per_node``
    (torchrun's LOCAL_WORLD_SIZE) lays out the 2-D mesh of ``parallel.shard_group=node``, whose groups get
    ``timeout`` (``dist.timeout_s``)."""
    wrapped = _wrap(model, cfg, device, precision, ranks_per_node, timeout)
    log.info("data parallel: %s", wrapped.strategy if wrapped.strategy != "none" else
             "none (world size 1: the bare model, no gradient sync; parallel.wrap_single=true wraps it)")
    clock = wrapped.comm_clock()
    if clock is not None and not clock.available:
        log.warning(clock.unavailable_reason())
    return wrapped


def _wrap(model: torch.nn.Module, cfg: ParallelConfig, device: torch.device, precision: str, ranks_per_node: int,
          timeout: timedelta | None) -> Wrapped:
    # One rank has nothing to synchronise: a wrapper would only add its own overhead to the single-device
    # baseline that scaling efficiency divides by. CPU offload still needs FSDP2 to move the state.
    if dist.get_world_size() == 1 and not (cfg.wrap_single or cfg.cpu_offload):
        return Wrapped(model, model, sync_switch(model), None, "none")
    if cfg.zero_stage >= 2:
        sharded = shard_model(model, cfg, device, precision, ranks_per_node, timeout)
        return Wrapped(sharded, model, sync_switch(sharded), None, f"FSDP2 (ZeRO-{cfg.zero_stage})")
    if cfg.engine != "torch":
        from ddptrain.engines import build_engine

        engine = build_engine(
            cfg.engine, model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=cfg.broadcast_buffers,
            collective=cfg.collective, kernels=cfg.kernels,
        )
        return Wrapped(engine, model, _no_sync_of(engine), EngineMeter(engine), f"engine {cfg.engine}")
    with warnings.catch_warnings():
        # torch 2.13 renames broadcast_buffers to forward_sync_buffers, which also syncs buffers at construction
        # when False; we keep broadcast_buffers' exact meaning (no sync at all), as our engines do.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated", category=FutureWarning)
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters,
            broadcast_buffers=cfg.broadcast_buffers,
        )
    strategy = f"torch DDP{' + ZeRO-1' if cfg.zero_stage == 1 else ''}" + (
        f" + {cfg.compression} compression" if cfg.compression != "none" else "")
    compression = register_compression(ddp, cfg)
    return Wrapped(ddp, model, sync_switch(ddp), compression.meter, strategy, compression)


def sync_switch(outer: torch.nn.Module) -> Callable[[bool], AbstractContextManager]:
    """How a step skips the gradient sync of ``outer`` on accumulation micro batches: ctx(sync), FSDP2's
    ``set_requires_gradient_sync`` (``fsdp_sync``), torch DDP's ``no_sync``, nothing for a bare model. The run's
    ``Wrapped.maybe_sync`` (our engines: their own ``no_sync``) and the memory plan's traced step both take it here."""
    if isinstance(outer, FSDPModule):
        return partial(fsdp_sync, outer)
    if isinstance(outer, DistributedDataParallel):
        return _no_sync_of(outer)
    return lambda _sync: nullcontext()


def _no_sync_of(module: torch.nn.Module) -> Callable[[bool], AbstractContextManager]:
    def ctx(sync: bool) -> AbstractContextManager:
        return nullcontext() if sync else module.no_sync()  # type: ignore[operator]

    return ctx
