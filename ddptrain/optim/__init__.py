"""AdamW (no decay on norms and biases) and the learning-rate schedules: warm-up, then cosine, WSD or constant."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ddptrain.config.choices import OptimImpl
from ddptrain.config.schema import OptimConfig
from ddptrain.errors import ConfigError


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and other 1-D tensors are left alone (as in GPT-2/Llama recipes)."""
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # LoRA trains matrices only: an empty group breaks DCP's loader


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, zero_stage: int = 0) -> torch.optim.Optimizer:
    """AdamW; at ZeRO stage 1 wrapped in ZeroRedundancyOptimizer, so each rank keeps 1/N of its state.

    Build it after the model is wrapped: FSDP2 (stages 2-3) replaces parameters with sharded DTensors.
    """
    groups = param_groups(model.named_parameters(), cfg.weight_decay)
    device = next(model.parameters()).device
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, **impl_kwargs(cfg.impl, device)}
    if zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def resolve_impl(impl: OptimImpl, device: torch.device) -> OptimImpl:
    """``auto``: fused where torch ships a fused AdamW kernel for the device (CUDA and CPU among them), else foreach.

    Fused is one kernel over all parameters and skips a non-finite step on the device (``found_inf``); on CPU it
    is also the fastest (see docs/benchmarks.md).
    """
    if impl != OptimImpl.auto:
        return impl
    return OptimImpl.fused if device.type in _get_fused_kernels_supported_devices() else OptimImpl.foreach


def impl_kwargs(impl: OptimImpl, device: torch.device) -> dict[str, bool]:
    """The AdamW keyword that selects ``impl``."""
    resolved = resolve_impl(impl, device)
    if resolved == OptimImpl.fused:
        if device.type not in _get_fused_kernels_supported_devices():
            raise ConfigError(f"optim.impl=fused: torch has no fused AdamW for {device.type} parameters; "
                              "use auto, foreach or for_loop")
        return {"fused": True}
    return {"foreach": resolved == OptimImpl.foreach}


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The AdamW that does the work: the one ZeRO-1's ``ZeroRedundancyOptimizer`` wraps (over this rank's shard),
    else ``optimizer`` itself. The one place that reaches through the wrapper."""
    return getattr(optimizer, "optim", optimizer)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the AdamW that does the work (the local one inside ZeRO-1's wrapper) runs the fused kernel."""
    return bool(local_optimizer(optimizer).defaults.get("fused"))


def lr_multiplier(cfg: OptimConfig, steps: int) -> Callable[[int], float]:
    """lr(step) / peak lr: linear warm-up, then the schedule, ending at ``min_lr_ratio``."""
    warmup, floor = min(cfg.warmup_steps, steps), cfg.min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "wsd":
            decay_start = steps - round(cfg.decay_fraction * steps)
            if step < max(decay_start, warmup):
                return 1.0
            progress = (step - max(decay_start, warmup)) / max(1, steps - max(decay_start, warmup))
            return 1.0 - (1.0 - floor) * min(progress, 1.0)
        progress = min((step - warmup) / max(1, steps - warmup), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(cfg, steps))
