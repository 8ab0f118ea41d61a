"""Model-state memory actually held per rank: parameters, gradients and optimizer state, by dtype, from tensor storage.

Each component is read when it peaks in the first training step. Parameters: at the start of every FSDP2 unit's
forward (just gathered) and at the end of the model's forward, keeping the largest reading. Each reading counts
the parameters the modules hold then (a gathered unit's unsharded working copy, e.g. bf16 under a mixed-precision
policy) and the sharded fp32 parameters that FSDP2 keeps beside it and the optimizer updates. Gradients: after
backward; optimizer state: after the step. Storage shared by several tensors (tied weights, an FSDP2 unit's
gathered buffer, DDP bucket views) counts once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ddptrain.plan import Precision, model_state_by_dtype

log = logging.getLogger("ddptrain")

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
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


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


def report_model_state(
    probe: ModelStateProbe, n_params: int, world_size: int, stage: int, shard_size: int, precision: Precision,
    trainable: int | None = None,
) -> dict[str, Any]:
    """Every rank's measured model-state bytes, by component and dtype, next to the planner's formula for the
    precision in use (``model_state_by_dtype``); logs this rank's.

    ``shard_size``: the ranks that share one copy of the state (the world, or a node's ranks under HSDP).
    Gradients and optimizer state exist for the ``trainable`` parameters only (all of them unless fine-tuning
    adapters on a frozen base).
    """
    per_rank: list[dict[str, ByDtype]] = [{}] * world_size
    dist.all_gather_object(per_rank, probe.bytes)
    formula = model_state_by_dtype(n_params, shard_size, stage, precision, probe.gathered)
    adapted = model_state_by_dtype(n_params if trainable is None else trainable, shard_size, stage, precision)
    expected = {"parameters": formula["parameters"], "gradients": adapted["gradients"],
                "optimizer": adapted["optimizer"]}
    mine = per_rank[dist.get_rank()]
    log.info("model state per rank (ZeRO-%d, sharded over %d of %d ranks, %s): %s", stage, shard_size, world_size,
             precision.name, ", ".join(f"{k} {_mib(mine[k])} (formula {_mib(expected[k])})" for k in expected))
    gathered = {2: "every parameter", 3: f"{probe.gathered} parameters (root + largest block)"}.get(stage)
    return {
        "zero_stage": stage, "shard_group_size": shard_size, "precision": precision.name,
        "formula_bytes": {k: sum(v.values()) for k, v in expected.items()},
        "formula_bytes_by_dtype": expected,
        "measured_bytes_per_rank": [{k: sum(v.values()) for k, v in held.items()} for held in per_rank],
        "measured_bytes_by_dtype_per_rank": per_rank,
        "formula": f"{precision.param_bytes}Ψ fp32 params + {precision.grad_bytes}Ψ fp32 grads + "
                   f"{precision.optim_bytes}Ψ AdamW, sharded per stage {stage}"
                   + (f", + {precision.gathered_bytes} bytes ({precision.gathered_dtype}) per gathered parameter: "
                      f"{gathered}" if gathered else ""),
    }


def _mib(held: dict[str, float]) -> str:
    """Bytes by dtype as ``0.13 MiB [bfloat16 0.07, float32 0.07]``: the total, then each dtype when there are
    several."""
    total = f"{sum(held.values()) / 2**20:.2f} MiB"
    if len(held) < 2:
        return total
    return total + " [" + ", ".join(f"{dtype} {n / 2**20:.2f}" for dtype, n in sorted(held.items())) + "]"


def device_memory(device: torch.device) -> dict[str, float]:
    """Peak device memory on CUDA; the process's resident memory on the CPU (GiB)."""
    if device.type == "cuda":
        return {
            "max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"rss_gib": psutil.Process().memory_info().rss / 2**30}
