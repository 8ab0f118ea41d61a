"""wrap(model, cfg): the data-parallel wrapper chosen by ``parallel.*``, and how to skip gradient sync."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import ParallelConfig
from ddptrain.errors import ConfigError


def validate_parallel_config(cfg: ParallelConfig) -> None:
    if cfg.bucket_cap_mb <= 0:
        raise ConfigError(f"parallel.bucket_cap_mb={cfg.bucket_cap_mb}: expected a positive size in MB")
    if cfg.engine != "torch":
        from ddptrain.engines import ENGINES

        if cfg.engine not in ENGINES:
            raise ConfigError(f"parallel.engine={cfg.engine!r}: expected one of torch, {', '.join(ENGINES)}")


def wrap_model(model: torch.nn.Module, cfg: ParallelConfig, device: torch.device) -> torch.nn.Module:
    """torch DDP with its real knobs, or one of our from-scratch engines with the same contract."""
    if cfg.engine != "torch":
        from ddptrain.engines import build_engine

        return build_engine(
            cfg.engine, model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=cfg.broadcast_buffers,
            collective=cfg.collective,
        )
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        find_unused_parameters=cfg.find_unused_parameters,
        forward_sync_buffers=cfg.broadcast_buffers,  # torch 2.13's name for broadcast_buffers
    )


def sync_context(model: torch.nn.Module) -> Callable[[bool], AbstractContextManager]:
    """``ctx(sync)``: a no-op when this micro-step must synchronize gradients, ``no_sync()`` otherwise."""

    def ctx(sync: bool) -> AbstractContextManager:
        return nullcontext() if sync else model.no_sync()  # type: ignore[operator]

    return ctx
