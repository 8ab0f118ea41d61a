"""Model-state memory actually held per rank: parameters, gradients and optimizer state, from tensor storage.

Each component is read when it peaks: parameters at the end of forward (ZeRO-2 holds them whole then, ZeRO-3
sharded), gradients after backward, optimizer state after the step. Shards count as held; storage shared by
several tensors (tied weights, DDP bucket views) counts once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psutil
import torch
from torch.distributed.tensor import DTensor


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank (a DTensor counts its local shard)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's own state tensors on this rank (ZeroRedundancyOptimizer: the local shard's optimizer)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


class ModelStateProbe:
    """Reads the three components once, each at its peak during the first training step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes: dict[str, int] = {}
        self._hook = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.bytes["parameters"] = held_bytes(module.parameters())
        self._hook.remove()

    def after_backward(self) -> None:
        self.bytes["gradients"] = held_bytes(p.grad for p in self.model.parameters())

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.bytes["optimizer"] = held_bytes(optimizer_state_tensors(optimizer))


def device_memory(device: torch.device) -> dict[str, float]:
    """Peak device memory on CUDA; the process's resident memory on the CPU (GiB)."""
    if device.type == "cuda":
        return {
            "max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"rss_gib": psutil.Process().memory_info().rss / 2**30}
