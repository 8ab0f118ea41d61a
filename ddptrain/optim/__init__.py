"""AdamW (no decay on norms and biases) and the learning-rate schedules: warm-up, then cosine, WSD or constant."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddptrain.config import OptimConfig


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and other 1-D tensors are left alone (as in GPT-2/Llama recipes).

    An empty group is left out (LoRA adapters are all matrices): torch's name-keyed optimizer state cannot load
    into an optimizer with an empty group.
    """
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, zero_stage: int = 0) -> torch.optim.Optimizer:
    """AdamW; at ZeRO stage 1 wrapped in ZeroRedundancyOptimizer, so each rank keeps 1/N of its state.

    Build it after the model is wrapped: FSDP2 (stages 2-3) replaces parameters with sharded DTensors.
    """
    groups = param_groups(model.named_parameters(), cfg.weight_decay)
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


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
