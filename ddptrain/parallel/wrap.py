"""wrap_model(model, cfg): the data-parallel strategy chosen by ``parallel.*`` and how to skip gradient sync."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import ParallelConfig
from ddptrain.errors import ConfigError
from ddptrain.kernels import check_kernels
from ddptrain.parallel.compression import CommMeter, register_compression, validate_compression
from ddptrain.parallel.zero import ZERO_STAGES, fsdp_sync, shard_model
from ddptrain.telemetry.comm import SyncSample, payload_from_link_bytes


@dataclass
class Wrapped:
    """What the training loop needs from a strategy."""

    module: torch.nn.Module  # call this for forward: DDP, a from-scratch engine, or the FSDP2-sharded model
    model: torch.nn.Module  # the underlying model (parameters, evaluation, export)
    maybe_sync: Callable[[bool], AbstractContextManager]  # ctx(sync): skip gradient sync when sync is False
    meter: CommMeter | None  # bytes the gradient hooks put on the wire (DDP-based strategies)

    def take_sync_sample(self, backward_end: float, world_size: int) -> tuple[SyncSample | None, float | None]:
        """The last step's gradient sync (bytes, time in flight, exposed time) and compression ratio; resets.

        torch DDP: from the metered hook's spans; backward compute ends when the last bucket is launched.
        Our engines: from their own ``comm_stats``. FSDP2 stages: not measured (None).
        """
        if self.meter is not None:
            last_launch = self.meter.last_launch()
            exposed = max(0.0, backward_end - last_launch) if last_launch is not None else 0.0
            sample = SyncSample(self.meter.comm_bytes, self.meter.comm_seconds(), exposed)
            ratio = self.meter.ratio
            self.meter.reset()
            return sample, ratio
        stats = getattr(self.module, "comm_stats", None)
        if stats is not None:
            payload = payload_from_link_bytes(stats.bytes_sent, world_size)
            return SyncSample(payload, stats.in_flight_s, stats.exposed_s), None
        return None, None


def validate_parallel_config(cfg: ParallelConfig) -> None:
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError(f"parallel.bucket_cap_mb={cfg.bucket_cap_mb}: expected a positive size in MB")
    if cfg.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"parallel.zero_stage={cfg.zero_stage}: expected 0, 1, 2 or 3")
    try:
        validate_compression(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.compression != "none" and cfg.zero_stage >= 2:
        raise ConfigError(
            f"parallel.compression={cfg.compression} cannot be combined with parallel.zero_stage={cfg.zero_stage}: "
            "compression hooks belong to DDP, and stages 2-3 reduce-scatter through FSDP2"
        )
    check_kernels(cfg.kernels, "cuda" if torch.cuda.is_available() else "cpu")
    if cfg.cpu_offload and cfg.zero_stage != 3:
        raise ConfigError(f"parallel.cpu_offload=true needs parallel.zero_stage=3 (got {cfg.zero_stage})")
    if cfg.engine == "torch":
        if cfg.collective != "native":
            raise ConfigError(
                f"parallel.collective={cfg.collective} needs a from-scratch parallel.engine (torch DDP uses native)"
            )
        return
    from ddptrain.engines import ENGINES

    if cfg.engine not in ENGINES:
        raise ConfigError(f"parallel.engine={cfg.engine!r}: expected one of torch, {', '.join(ENGINES)}")
    for key, value, default in (("zero_stage", cfg.zero_stage, 0), ("compression", cfg.compression, "none")):
        if value != default:
            raise ConfigError(
                f"parallel.engine={cfg.engine} cannot be combined with parallel.{key}={value}: "
                "ZeRO and compression hooks run on torch DDP (parallel.engine=torch)"
            )


def wrap_model(model: torch.nn.Module, cfg: ParallelConfig, device: torch.device) -> Wrapped:
    """torch DDP (stages 0-1, with its knobs and a compression hook), FSDP2 (stages 2-3), or our own engines."""
    if cfg.zero_stage >= 2:
        sharded = shard_model(model, cfg, device)
        return Wrapped(sharded, model, partial(fsdp_sync, sharded), None)
    if cfg.engine != "torch":
        from ddptrain.engines import build_engine

        engine = build_engine(
            cfg.engine, model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=cfg.broadcast_buffers,
            collective=cfg.collective, kernels=cfg.kernels,
        )
        return Wrapped(engine, model, _no_sync_of(engine), None)
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
    return Wrapped(ddp, model, _no_sync_of(ddp), register_compression(ddp, cfg))


def _no_sync_of(module: torch.nn.Module) -> Callable[[bool], AbstractContextManager]:
    def ctx(sync: bool) -> AbstractContextManager:
        return nullcontext() if sync else module.no_sync()  # type: ignore[operator]

    return ctx
