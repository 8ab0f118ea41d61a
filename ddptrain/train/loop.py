"""The training loop: build, loop (accumulate, sync, clip, step), log, evaluate, summarise."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ddptrain.config import Config
from ddptrain.data import BatchPlan, MicroBatches, build_token_data, eval_batches
from ddptrain.models import build_model, model_vocab_size
from ddptrain.optim import build_optimizer, build_scheduler
from ddptrain.parallel import wrap_model
from ddptrain.plan import FP32, model_state_memory
from ddptrain.runtime import DistEnv, main_first, seed_everything
from ddptrain.telemetry import Sinks
from ddptrain.telemetry.memory import ModelStateProbe, device_memory

log = logging.getLogger("ddptrain")


def train(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any]) -> dict[str, Any]:
    plan = BatchPlan.derive(
        cfg.data.global_batch_size, cfg.data.micro_batch_size, cfg.data.grad_accum, env.world_size, cfg.data.seq_len
    )
    log.info("run dir %s | %d ranks on %s | %s", run_dir, env.world_size, device.type, plan.equation())
    seed_everything(cfg.train.seed)

    data = main_first(env, lambda: build_token_data(cfg.data))
    eos_id = data.tokenizer.eos_token_id if data.tokenizer is not None else None
    model = build_model(cfg.model, model_vocab_size(cfg.model, data.vocab_size), eos_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters | %d train / %d val sequences", cfg.model.name, n_params / 1e6,
             len(data.train), len(data.val))
    wrapped = wrap_model(model, cfg.parallel, device)
    optimizer = build_optimizer(model, cfg.optim, cfg.parallel.zero_stage)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    batches = MicroBatches(data.train, plan, env.rank, cfg.train.seed, cfg.data.shuffle, cfg.data.num_workers, device)
    val = eval_batches(data.val, plan.micro_batch_size, plan.dp, env.rank, cfg.train.eval_batches)
    autocast = autocast_context(cfg.train.precision, device)
    sinks = Sinks.build(cfg.logger, env.is_main, run_dir, cfg.train.steps, resolved)
    probe = ModelStateProbe(model)

    history: list[dict[str, Any]] = []
    model_state: dict[str, Any] = {}
    window_start, window_steps = _now(device), 0
    try:
        for step in range(1, cfg.train.steps + 1):
            loss = accumulate_gradients(wrapped.module, batches, plan.grad_accum, wrapped.maybe_sync, autocast)
            if step == 1:
                probe.after_backward()
            grad_norm = optimizer_step(model, optimizer, cfg.optim.grad_clip)
            if step == 1:
                probe.after_step(optimizer)
                model_state = report_model_state(probe.bytes, n_params, env.world_size, cfg.parallel.zero_stage)
            comm_bytes = wrapped.meter.comm_bytes if wrapped.meter else None
            comm_ratio = wrapped.meter.ratio if wrapped.meter else None
            if wrapped.meter:
                wrapped.meter.reset()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            window_steps += 1
            if step % cfg.train.log_every and step != cfg.train.steps:
                continue
            elapsed = _now(device) - window_start
            metrics = {
                "step": step,
                "loss": global_mean(loss),
                "lr": lr,
                "grad_norm": float(grad_norm),
                "step_time_s": elapsed / window_steps,
                "tokens_per_s": plan.tokens_per_step * window_steps / elapsed,
                "tokens_per_s_per_rank": plan.tokens_per_step * window_steps / elapsed / env.world_size,
                "tokens_seen": plan.tokens_per_step * step,
            }
            if comm_bytes is not None:
                metrics.update(comm_bytes=comm_bytes, compression_ratio=comm_ratio)
            metrics.update(device_memory(device))
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                metrics["val_loss"] = evaluate(model, val, autocast)
            sinks.log(metrics)
            history.append(metrics)
            window_start, window_steps = _now(device), 0
    finally:
        sinks.close()
    summary = summarise(history, plan, env, n_params, cfg)
    summary["model_state"] = model_state
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def accumulate_gradients(
    ddp: torch.nn.Module, micro_batches: Iterator[torch.Tensor], grad_accum: int,
    maybe_sync: Callable[[bool], AbstractContextManager], autocast: AbstractContextManager,
) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` micro batches, syncing gradients only on the last one.

    The loss is scaled by 1/grad_accum, so the synced ``.grad`` is the mean over the whole global batch.
    Returns this rank's mean loss over its micro batches.
    """
    loss_sum: torch.Tensor | None = None
    for micro in range(grad_accum):
        ids = next(micro_batches)
        with maybe_sync(micro == grad_accum - 1):
            with autocast:
                loss = ddp(input_ids=ids, labels=ids).loss / grad_accum
            loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    assert loss_sum is not None
    return loss_sum


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
    """Clip to ``grad_clip`` global norm (0: no clipping), step, clear; returns the norm before clipping.

    With sharded gradients (FSDP2) the norm is a DTensor reduced over all shards; its full value is returned.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def report_model_state(held: dict[str, int], n_params: int, world_size: int, stage: int) -> dict[str, Any]:
    """Measured model-state bytes of every rank next to the ZeRO formula for fp32 parameters + AdamW."""
    per_rank: list[dict[str, int]] = [{}] * world_size
    dist.all_gather_object(per_rank, held)
    formula = model_state_memory(n_params, world_size, stage, FP32)
    expected = {"parameters": formula.params, "gradients": formula.grads, "optimizer": formula.optimizer}
    mine = per_rank[dist.get_rank()]
    log.info(
        "model state per rank (ZeRO-%d, %d ranks): %s",
        stage, world_size,
        ", ".join(f"{k} {mine[k] / 2**20:.2f} MiB (formula {expected[k] / 2**20:.2f})" for k in expected),
    )
    return {"zero_stage": stage, "formula_bytes": expected, "measured_bytes_per_rank": per_rank,
            "formula": f"{FP32.param_bytes}Ψ params + {FP32.grad_bytes}Ψ grads + {FP32.optim_bytes}Ψ AdamW, "
                       f"sharded per stage {stage}"}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], autocast: AbstractContextManager) -> float:
    """Mean validation loss over every rank's fixed batches (the same batches at every evaluation)."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for ids in batches:
        ids = ids.to(device)
        with autocast:
            total[0] += model(input_ids=ids, labels=ids).loss.double() * len(ids)
        total[1] += len(ids)
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def global_mean(value: torch.Tensor) -> float:
    """The mean of a per-rank scalar over all ranks (each rank saw the same number of tokens)."""
    buf = value.detach().double().reshape(1).clone()
    dist.all_reduce(buf)
    return float(buf) / dist.get_world_size()


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CUDA by default; fp32 on CPU unless bf16 is asked for."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def summarise(history: list[dict[str, Any]], plan: BatchPlan, env: DistEnv, n_params: int, cfg: Config) -> dict:
    """End-of-run figures; throughput is the median over logged windows after the first (warm-up)."""
    steady = history[1:] or history
    summary: dict[str, Any] = {
        "world_size": env.world_size,
        "model": cfg.model.name,
        "parameters": n_params,
        "engine": cfg.parallel.engine,
        "zero_stage": cfg.parallel.zero_stage,
        "compression": cfg.parallel.compression,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "seq_len": plan.seq_len,
        "steps": cfg.train.steps,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "final_val_loss": next((m["val_loss"] for m in reversed(history) if "val_loss" in m), None),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady) if steady else None,
        "step_time_s": statistics.median(m["step_time_s"] for m in steady) if steady else None,
    }
    return summary


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
