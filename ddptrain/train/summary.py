"""The run's reports: measured model state, by dtype, next to the planner's formula (first step), and
summary.json's figures."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ddptrain.plan.analytic.planner import model_state_by_dtype, step_comm
from ddptrain.plan.costs import FP32, StateBytes
from ddptrain.telemetry.memory import ByDtype, ModelStateProbe
from ddptrain.telemetry.metrics import steady_medians
from ddptrain.telemetry.summary import RunSummary, SteadyFigures

if TYPE_CHECKING:
    from ddptrain.train.components import Trainer

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


def summarise(history: list[dict[str, Any]], t: Trainer, model_state: dict[str, Any]) -> RunSummary:
    """End-of-run figures of trainer ``t``: steady-state medians (first window skipped), config essentials,
    predictions.

    Gradients, hence communication, exist for the trainable parameters only. ``buckets``: the last timed step's
    gradient buckets as (seconds before backward compute ended that each was ready, bytes), which calibrate the
    what-if predictor (``plan.from_run``).
    """
    cfg, shape, trainable = t.cfg, t.shape, t.trainable
    predicted_comm = step_comm(trainable, shape.dp, cfg.parallel.zero_stage, FP32)
    return RunSummary(
        world_size=shape.dp,
        model=cfg.model.name,
        parameters=t.n_params,
        trainable_parameters=trainable,
        engine=cfg.parallel.engine,
        zero_stage=cfg.parallel.zero_stage,
        compression=cfg.parallel.compression,
        wrapper=t.wrapped.strategy,
        global_batch_size=shape.global_batch_size,
        micro_batch_size=shape.micro_batch_size,
        grad_accum=shape.grad_accum,
        seq_len=shape.seq_len,
        steps=cfg.train.steps,
        first_loss=history[0]["loss"] if history else None,
        final_loss=history[-1]["loss"] if history else None,
        final_val_loss=next((m["val_loss"] for m in reversed(history) if "val_loss" in m), None),
        tokens_seen=history[-1]["tokens_seen"] if history else None,  # since step 1, a resumed run's included
        steady=SteadyFigures(steady_medians(history) if history else {}),
        flops_per_token=t.flops_per_token,
        peak_tflops=t.metrics.peak_tflops,
        predicted={
            # All-reduce of fp32 gradients: payload S = 4Ψ; each rank sends 2(N-1)/N·S (what the plan prints).
            "comm_payload_bytes": 4.0 * trainable if cfg.parallel.zero_stage < 2 and shape.dp > 1 else None,
            "comm_link_bytes_per_rank": predicted_comm.nbytes,
        },
        model_state=model_state,
        buckets=[[lead, nbytes] for lead, nbytes in t.metrics.buckets],
    )
