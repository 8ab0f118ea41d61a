"""The run's reports: measured model state next to the ZeRO formula (first step), and summary.json's figures."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ddptrain.config import Config
from ddptrain.data import BatchPlan
from ddptrain.plan import FP32, model_state_memory, step_comm
from ddptrain.telemetry.metrics import steady_medians

log = logging.getLogger("ddptrain")


def report_model_state(
    held: dict[str, int], n_params: int, world_size: int, stage: int, shard_size: int, trainable: int | None = None
) -> dict[str, Any]:
    """Measured model-state bytes of every rank next to the ZeRO formula for fp32 parameters + AdamW.

    ``shard_size``: the ranks that share one copy of the state (the world, or a node's ranks under HSDP).
    Gradients and optimizer state exist for the ``trainable`` parameters only (all of them unless fine-tuning
    adapters on a frozen base).
    """
    per_rank: list[dict[str, int]] = [{}] * world_size
    dist.all_gather_object(per_rank, held)  # sync point: once, after the first step
    formula = model_state_memory(n_params, shard_size, stage, FP32)
    adapted = model_state_memory(n_params if trainable is None else trainable, shard_size, stage, FP32)
    expected = {"parameters": formula.params, "gradients": adapted.grads, "optimizer": adapted.optimizer}
    mine = per_rank[dist.get_rank()]
    log.info(
        "model state per rank (ZeRO-%d, sharded over %d of %d ranks): %s",
        stage, shard_size, world_size,
        ", ".join(f"{k} {mine[k] / 2**20:.2f} MiB (formula {expected[k] / 2**20:.2f})" for k in expected),
    )
    return {"zero_stage": stage, "shard_group_size": shard_size, "formula_bytes": expected,
            "measured_bytes_per_rank": per_rank,
            "formula": f"{FP32.param_bytes}Ψ params + {FP32.grad_bytes}Ψ grads + {FP32.optim_bytes}Ψ AdamW, "
                       f"sharded per stage {stage}"}


def summarise(
    history: list[dict[str, Any]], plan: BatchPlan, n_params: int, fpt: float, peak: float | None, cfg: Config,
    model_state: dict[str, Any], wrapper: str, trainable: int | None = None,
    buckets: tuple[tuple[float, int], ...] = (),
) -> dict[str, Any]:
    """End-of-run figures: steady-state medians (first window skipped), config essentials, predictions.

    Gradients, hence communication, exist for the ``trainable`` parameters only (default: all of them).
    ``buckets``: the last timed step's gradient buckets as (seconds before backward compute ended that each
    was ready, bytes), which calibrate the what-if predictor (``plan.from_run``).
    """
    trainable = n_params if trainable is None else trainable
    predicted_comm = step_comm(trainable, plan.dp, cfg.parallel.zero_stage, FP32)
    return {
        "world_size": plan.dp,
        "model": cfg.model.name,
        "parameters": n_params,
        "trainable_parameters": trainable,
        "engine": cfg.parallel.engine,
        "zero_stage": cfg.parallel.zero_stage,
        "compression": cfg.parallel.compression,
        "wrapper": wrapper,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "seq_len": plan.seq_len,
        "steps": cfg.train.steps,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "final_val_loss": next((m["val_loss"] for m in reversed(history) if "val_loss" in m), None),
        **(steady_medians(history) if history else {}),
        "flops_per_token": fpt,
        "peak_tflops": peak,
        "predicted": {
            # All-reduce of fp32 gradients: payload S = 4Ψ; each rank sends 2(N-1)/N·S (what the plan prints).
            "comm_payload_bytes": 4.0 * trainable if cfg.parallel.zero_stage < 2 and plan.dp > 1 else None,
            "comm_link_bytes_per_rank": predicted_comm.nbytes,
        },
        "model_state": model_state,
        "buckets": [[lead, nbytes] for lead, nbytes in buckets],
    }
