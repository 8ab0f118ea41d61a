"""Model-state memory actually held per rank: parameters, gradients and optimizer state, by dtype, from tensor storage.

Each component is read when it peaks in the first training step. Parameters: at the start of every FSDP2 unit's
forward (just gathered) and at the end of the model's forward, keeping the largest reading. Each reading counts
the parameters the modules hold then (a gathered unit's unsharded working copy, e.g. bf16 under a mixed-precision
policy) and the sharded fp32 parameters that FSDP2 keeps beside it and the optimizer updates. Gradients: after
backward; optimizer state: after the step. Storage shared by several tensors (tied weights, an FSDP2 unit's
gathered buffer, DDP bucket views) counts once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psutil
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ddptrain.optim import local_optimizer

ByDtype = dict[str, int]  # "float32" -> bytes


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> ByDtype:
    """Bytes of the distinct storages behind ``tensors`` on this rank, by dtype (a DTensor counts its local shard)."""
    seen: set[tuple[str, int]] = set()
    total: ByDtype = {}
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            dtype = str(local.dtype).removeprefix("torch.")
            total[dtype] = total.get(dtype, 0) + storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's own state tensors on this rank (ZeroRedundancyOptimizer: the local shard's optimizer)."""
    return [v for state in local_optimizer(optimizer).state.values() for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0]


def largest_gather(model: torch.nn.Module) -> int:
    """Parameters that FSDP2 holds unsharded at once in ZeRO-3's forward: the root unit's (every parameter outside
    the other units, gathered for the whole forward) plus the largest other unit's (a transformer block)."""
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules()
             if isinstance(m, FSDPModule) and m is not model]
    return sum(p.numel() for p in model.parameters()) - sum(units) + max(units, default=0)


class ModelStateProbe:
    """Reads the three components once, each at its peak during the first training step.

    The parameter objects are taken at construction, before the first forward: under FSDP2 they are the sharded
    fp32 parameters, which stay alive (and stay the optimizer's) while a unit's modules hold the gathered copy.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes: dict[str, ByDtype] = {}
        self._params = list(model.parameters())
        self.gathered = largest_gather(model)
        self._hooks = [m.register_forward_pre_hook(self._read_parameters) for m in model.modules()
                       if isinstance(m, FSDPModule)]
        self._hooks.append(model.register_forward_hook(self._after_forward))

    @torch.compiler.disable  # a hook of a compiled block (train.compile): run eagerly, never traced
    def _read_parameters(self, *_: Any) -> None:
        held = held_bytes([*self._params, *self.model.parameters()])
        if sum(held.values()) > sum(self.bytes.get("parameters", {}).values()):
            self.bytes["parameters"] = held

    def _after_forward(self, *_: Any) -> None:
        self._read_parameters()
        for hook in self._hooks:
            hook.remove()

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
