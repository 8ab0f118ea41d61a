"""The training loop: build, loop (accumulate, sync, clip, step), log, evaluate, summarise."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM

from ddptrain.checkpoint import Checkpointer, TrainState
from ddptrain.config import Config, DataFormat, computes_in_bf16
from ddptrain.data import BatchPlan, MicroBatches, build_token_data, eval_batches
from ddptrain.errors import RunEnded
from ddptrain.faults import delay, inject, poison_loss
from ddptrain.kernels.clip import clip_grad_norm
from ddptrain.models import build_model, model_vocab_size
from ddptrain.models.flops import flops_per_token
from ddptrain.models.lora import (
    export_adapter_and_merged,
    is_adapted,
    parameter_counts,
    prepare_for_finetuning,
    reentrant_failure,
    trainable_line,
)
from ddptrain.optim import build_optimizer, build_scheduler, is_fused
from ddptrain.parallel import wrap_model
from ddptrain.parallel.compile import compile_blocks
from ddptrain.parallel.zero import shard_group_size
from ddptrain.plan import FP32, MIXED_BF16, step_comm
from ddptrain.runtime import DistEnv, main_first, seed_everything
from ddptrain.telemetry import Sinks
from ddptrain.telemetry.memory import ModelStateProbe, report_model_state
from ddptrain.telemetry.metrics import StepMetrics, load_baseline, steady_medians
from ddptrain.telemetry.profile import StepProfiler
from ddptrain.telemetry.stragglers import StragglerMonitor
from ddptrain.telemetry.timers import StepTimer, device_clock
from ddptrain.topology import gather_topology
from ddptrain.train.control import NonFiniteSteps, StopRequest, agree, guard_loss
from ddptrain.train.tokens import MicroBatch, accumulate_token_weighted, loss_tokens

log = logging.getLogger("ddptrain")


def train(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any]) -> dict[str, Any]:
    plan = BatchPlan.from_config(cfg, env.world_size)
    topology = gather_topology(env)
    log.info("run dir %s | %d ranks on %s | %s | %s", run_dir, env.world_size, device.type, topology.describe(),
             plan.equation())
    seed_everything(cfg.train.seed)

    data = main_first(env, lambda: build_token_data(cfg.data), cfg.data.prepare_timeout_s)
    vocab = model_vocab_size(cfg.model, data.vocab_size)
    model = build_model(cfg.model, vocab, data.tokenizer.eos_token_id if data.tokenizer else None, device)
    model = prepare_for_finetuning(model.to(device), cfg.model)
    trainable, n_params = parameter_counts(model)
    log.info("model %s: %.2fM parameters (%s) | %d train / %d val sequences", cfg.model.name, n_params / 1e6,
             trainable_line(trainable, n_params, None), len(data.train), len(data.val))
    if cfg.train.compile:
        log.info("train.compile: compiling %d transformer blocks (on the first step)", compile_blocks(model))
    wrapped = wrap_model(model, cfg.parallel, device, cfg.train.precision, env.local_world_size)
    # Every rank built the same initial weights from train.seed (and DDP broadcasts rank 0's). From here on each
    # rank draws from its own stream (dropout masks differ across ranks, as in one large-batch run); checkpoints
    # save and restore each rank's stream.
    seed_everything(cfg.train.seed + env.rank)
    optimizer = build_optimizer(model, cfg.optim, cfg.parallel.zero_stage)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    batches = MicroBatches(data.train, plan, env.rank, cfg.train.seed, cfg.data.shuffle, cfg.data.num_workers, device,
                           data.collate)
    token_weighted = cfg.data.format == DataFormat.prompt_completion
    checkpointer = Checkpointer(cfg, run_dir, wrapped.strategy, data.tokenizer)
    start = resume(checkpointer, resume_target(cfg.train.resume), model, optimizer, scheduler, batches, plan)
    val = eval_batches(data.val, plan.micro_batch_size, plan.dp, env.rank, cfg.train.eval_batches, data.collate)
    autocast = autocast_context(cfg.train.precision, device)
    # A pretrained model's shape is not in model.*: 2N forward + 2N input gradients + 2 per trainable weight.
    fpt = (flops_per_token(cfg.model, vocab, plan.seq_len) if cfg.model.pretrained is None
           else 4.0 * n_params + 2.0 * trainable)
    meter = StepMetrics(plan, device, fpt, cfg.metrics.peak_tflops, load_baseline(cfg.metrics.baseline),
                        cfg.metrics.sample_every)
    sinks = Sinks.build(cfg.logger, env.is_main, run_dir, cfg.train.steps, resolved)
    probe = ModelStateProbe(model)
    if wrapped.module is not model:  # a wrapper that may sync before the model's own forward (DDP, our engines)
        model.register_forward_pre_hook(lambda *_: meter.timer.inner_forward_started())
    stragglers = StragglerMonitor(topology.hosts, cfg.metrics.straggler_windows, cfg.metrics.straggler_pct)
    stop = StopRequest(cfg.launch.stop_grace_s)

    def save(step: int, wait: bool) -> None:
        state = TrainState(step, scheduler.state_dict(), batches.epoch, batches.position, plan.dp,
                           plan.global_batch_size, cfg.parallel.zero_stage)
        checkpointer.save(state, model, optimizer, wait)

    history: list[dict[str, Any]] = []
    model_state: dict[str, Any] = {}
    skipped = 0
    nonfinite_steps = NonFiniteSteps(device)
    compile_s: float | None = None
    first_step_start = device_clock(device)
    with closing(sinks), StepProfiler(cfg.profile, run_dir, env.rank, device) as profiler:
        for step in range(start + 1, cfg.train.steps + 1):
            meter.start_step(step)
            delay(step, env.rank, meter.timer.phase)
            guard = _poisoned if poison_loss(step, env.rank) else guard_loss
            try:
                loss = accumulate_gradients(wrapped.module, batches, plan.grad_accum, wrapped.maybe_sync, autocast,
                                            meter.timer, token_weighted, guard)
            except RuntimeError as exc:
                if cfg.model.checkpoint_reentrant:
                    raise reentrant_failure(exc) from exc
                raise
            if step == start + 1:
                probe.after_backward()
            log_step = step % cfg.train.log_every == 0 or step == cfg.train.steps
            save_step = step == cfg.train.steps or _every(step, cfg.checkpoint.every_n_steps)
            stopping = 0  # the agreed signal number; 0: go on
            with meter.timer.phase("optimizer"):
                grad_norm = clip_gradients(model, cfg.optim.grad_clip, cfg.parallel.kernels)
                nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank (see guard_loss)
                apply_update(optimizer, nonfinite)
                nonfinite_steps.record(nonfinite, step)
                if log_step or save_step or step % cfg.train.check_every == 0:
                    stopping, count, first = agree(stop.signum, nonfinite_steps)
                    skipped += settle_nonfinite(count, first, step, cfg.train.nan_policy)
            sample, ratio = wrapped.take_sync_sample(env.world_size, meter.timer.active)
            meter.end_step(sample, ratio)
            if cfg.train.compile and step == start + 1:
                compile_s = device_clock(device) - first_step_start
                log.info("train.compile: first step %.1f s, compilation included (kept out of throughput)", compile_s)
                if not log_step:
                    meter.restart_window()
            if step == start + 1:
                log.info("%s", trainable_line(trainable, n_params, sample.payload_bytes if sample else None))
                probe.after_step(optimizer)
                model_state = report_model_state(
                    probe, n_params, env.world_size, cfg.parallel.zero_stage,
                    shard_group_size(cfg.parallel, env.world_size, env.local_world_size),
                    MIXED_BF16 if computes_in_bf16(cfg.train.precision, device.type) else FP32, trainable)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            profiler.step()
            inject("step", step, env.rank)
            if stopping or save_step:
                save(step, wait=bool(stopping) or step == cfg.train.steps)  # the last save is committed before exit
            if stopping:
                stop.restore()
                raise Stopped(f"stopped by {signal.Signals(stopping).name} after step {step}; checkpoint saved "
                              f"in {checkpointer.root}; continue with train.resume=auto", stopping)
            if not log_step:
                continue
            metrics = meter.window(step, global_mean(loss), lr, float(grad_norm))
            metrics["skipped_steps"] = skipped
            metrics.update(stragglers.window(metrics))
            if _every(step, cfg.train.eval_every) or (cfg.train.eval_every and step == cfg.train.steps):
                metrics["val_loss"] = evaluate(model, val, autocast, device)
            sinks.log(metrics)
            history.append(metrics)
            meter.restart_window()
    stop.restore()
    if cfg.checkpoint.export and is_adapted(model):
        if env.is_main:
            export_adapter_and_merged(model, cfg.model, data.tokenizer, run_dir)
        dist.barrier()
    elif cfg.checkpoint.export:
        checkpointer.export(model, lambda: AutoModelForCausalLM.from_config(model.config), data.tokenizer,
                            run_dir / "model")
    summary = summarise(history, plan, n_params, fpt, meter.peak, cfg, model_state, wrapped.strategy, trainable,
                        meter.buckets)
    if compile_s is not None:
        summary["compile_s"] = compile_s
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


class Stopped(RunEnded):
    """A requested stop (SIGTERM/SIGINT) completed: the checkpoint is safe, the process exits 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, 128 + signum)


class NonFiniteError(RunEnded):
    """train.nan_policy=abort met a non-finite loss or gradient (decided alike on every rank)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 3)


def resume_target(configured: str | None) -> str | None:
    """``train.resume``, except that a worker restarted by the elastic agent always continues (auto)."""
    if configured is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        log.warning("restarted by the elastic agent: resuming from the latest checkpoint (train.resume=auto)")
        return "auto"
    return configured


def resume(
    checkpointer: Checkpointer, resume_from: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR, batches: MicroBatches, plan: BatchPlan,
) -> int:
    """Load the checkpoint ``train.resume`` names (if any); returns the step to continue after."""
    checkpointer.remove_partial()
    path = checkpointer.resolve(resume_from)
    if path is None:
        if resume_from == "auto":
            log.info("train.resume=auto: no checkpoint in %s, starting from step 0", checkpointer.root)
        return 0
    state = checkpointer.load(path, model, optimizer)
    scheduler.load_state_dict(state.scheduler)
    batches.load_state_dict({"epoch": state.epoch, "position": state.samples_in_epoch})
    if state.world_size != plan.dp:
        log.warning("resuming on %d ranks from a checkpoint of %d: grad_accum %d keeps the global batch of %d",
                    plan.dp, state.world_size, plan.grad_accum, plan.global_batch_size)
    if state.global_batch_size != plan.global_batch_size:
        log.warning("the checkpoint trained with a global batch of %d; continuing with %d",
                    state.global_batch_size, plan.global_batch_size)
    log.info("resumed from %s at step %d", path, state.step)
    return state.step


def accumulate_gradients(
    module: torch.nn.Module, micro_batches: Iterator[torch.Tensor], grad_accum: int,
    maybe_sync: Callable[[bool], AbstractContextManager], autocast: AbstractContextManager,
    timer: StepTimer | None = None, token_weighted: bool = False,
    loss_guard: Callable[[torch.Tensor], torch.Tensor] = guard_loss,
) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` micro batches, syncing gradients only on the last one.

    Packed blocks: the loss is scaled by 1/grad_accum, so the synced ``.grad`` is the mean over the whole global
    batch. Returns this rank's mean loss over its micro batches. ``token_weighted`` (padded prompt/completion
    batches): the mean over every loss token of the global batch instead (see ``train/tokens.py``).
    ``loss_guard`` makes a non-finite loss poison the gradients, so the sync spreads it to every rank.
    """
    phase = timer.phase if timer is not None else (lambda _: nullcontext())
    if token_weighted:
        return accumulate_token_weighted(module, micro_batches, grad_accum, maybe_sync, autocast, phase,
                                         loss_guard)
    loss_sum: torch.Tensor | None = None
    for micro in range(grad_accum):
        with phase("data"):
            ids = next(micro_batches)
        with maybe_sync(micro == grad_accum - 1):
            with phase("forward"), autocast:
                loss = loss_guard(module(input_ids=ids, labels=ids).loss / grad_accum)
            with phase("backward"):
                loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    assert loss_sum is not None
    return loss_sum


def clip_gradients(model: torch.nn.Module, grad_clip: float, kernels: str = "auto") -> torch.Tensor:
    """Clip to ``grad_clip`` global norm (0: no clipping) on ``kernels``' norm and scaling (``parallel.kernels``);
    returns the norm before clipping.

    With clipping off only the norm is computed (it is logged and checked for non-finite values), never the
    scaling pass. With sharded gradients (FSDP2) the norm is a DTensor reduced over all shards (on the CPU with
    CPU offload, hence gloo next to NCCL); its full value is returned.
    """
    grad_norm = clip_grad_norm(model.parameters(), grad_clip if grad_clip > 0 else None, kernels)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def apply_update(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """Step the optimizer unless this step's gradients are non-finite (a verdict the same on every rank).

    Fused AdamW takes the verdict as ``found_inf`` and skips on the device (parameters, moments and step count
    untouched), so the host waits for nothing. The other kernels cannot skip on a device flag: for them the
    host reads the verdict. Gradients are cleared either way.
    """
    if is_fused(optimizer):
        getattr(optimizer, "optim", optimizer).found_inf = nonfinite.float()  # ZeRO-1: the local AdamW
        optimizer.step()
    elif not bool(nonfinite):  # sync point (foreach / for_loop only): the host needs the verdict to branch
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def settle_nonfinite(count: int, first: int, step: int, nan_policy: str) -> int:
    """At a check step: abort, or report the skipped updates (already skipped on every rank); returns the count.

    Checks come before every checkpoint, so an aborted run never saves a state after its non-finite step.
    """
    if count and nan_policy == "abort":
        raise NonFiniteError(f"non-finite loss or gradients at step {first} (train.nan_policy=abort); "
                             "no checkpoint was written for it")
    if count:
        more = f" and {count - 1} more up to step {step}" if count > 1 else ""
        log.warning("non-finite loss or gradients at step %d%s: update skipped on every rank", first, more)
    return count


def _poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The loss of a step that fault injection poisons: NaN, before backward, as a real non-finite loss is."""
    return guard_loss(loss * math.nan)


def _every(step: int, period: int) -> bool:
    """True every ``period`` steps; never when the period is 0 (disabled)."""
    return period > 0 and step % period == 0


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[torch.Tensor | MicroBatch], autocast: AbstractContextManager,
    device: torch.device,
) -> float:
    """Mean validation loss over every rank's fixed batches (the same batches at every evaluation).

    Packed blocks: the mean of sequence means (every block has as many tokens); padded prompt/completion
    batches: the mean over their loss tokens. ``device`` is the run's: with CPU offload the parameters sit on
    the CPU while compute and NCCL use the GPU.
    """
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in batches:
        if isinstance(batch, dict):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast:  # num_items_in_batch=1: the model returns the summed token loss
                total[0] += model(**batch, num_items_in_batch=1).loss.double()
            total[1] += loss_tokens(batch["labels"])
            continue
        ids = batch.to(device)
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
    if not computes_in_bf16(precision, device.type):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


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
