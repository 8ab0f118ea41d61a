"""The first step's report: measured model state, by dtype, next to the planner's formula (summary.json's
``model_state``; the rest of the summary is ``Trainer.summary``)."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ddptrain.plan.analytic.planner import model_state_by_dtype
from ddptrain.plan.costs import StateBytes
from ddptrain.telemetry.memory import ByDtype, ModelStateProbe

log = logging.getLogger("ddptrain")


def report_model_state(
    probe: ModelStateProbe, n_params: int, world_size: int, stage: int, shard_size: int, precision: StateBytes,
    trainable: int | None = None,
) -> dict[str, Any]:
    """Every rank's measured model-state bytes, by component and dtype, next to the planner's formula for the
    precision in use (``model_state_by_dtype``); logs this rank's.

    ``shard_size``: the ranks that share one copy of the state (the world, or a node's ranks under HSDP).
    Gradients and optimizer state exist for the ``trainable`` parameters only (all of them unless fine-tuning
    adapters on a frozen base).
    """
    per_rank: list[dict[str, ByDtype]] = [{}] * world_size
    dist.all_gather_object(per_rank, probe.bytes)  # sync point: once, after the first step
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
