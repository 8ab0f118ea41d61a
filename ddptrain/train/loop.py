"""The training loop: build once, then per step accumulate (with the gradient sync), clip, update, log, evaluate,
save; export and summarise at the end.

Sync points, where the host waits for the device or for other ranks, are marked where they happen. A steady
step has none besides the gradient collective (with fused AdamW, and except the step-breakdown timer's sampled
steps, ``metrics.sample_every``); check, logging and save steps sync by design.
"""

from __future__ import annotations

import json
import logging
import signal
from contextlib import closing
from pathlib import Path
from typing import Any

import torch

from ddptrain.config.schema import Config
from ddptrain.diagnose.whereabouts import WHEREABOUTS
from ddptrain.models.lora import reentrant_failure
from ddptrain.plan.memory.own_peak import MeasuredPeak, memory_peak, planned_peak
from ddptrain.plan.whatif.own_run import predict_own_step
from ddptrain.runtime.process_group import DistEnv
from ddptrain.telemetry.goodput import Goodput, attempt_start, continuing, goodput_line
from ddptrain.telemetry.profile import StepProfiler
from ddptrain.train.components import Components, build_components
from ddptrain.train.control import (
    NonFiniteError,
    NonFiniteSteps,
    Stopped,
    agree,
    guard_loss,
    overflowing,
    poisoned,
)
from ddptrain.train.first_step import FirstStep
from ddptrain.train.step import accumulate_gradients, apply_update, clip_gradients, evaluate, global_mean
from ddptrain.train.summary import summarise

log = logging.getLogger("ddptrain")


def train(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank (every rank runs this alike); returns the run's summary, which rank 0 also writes to
    ``summary.json``."""
    started = attempt_start()  # goodput's wall-clock: this attempt's start (the launcher's, or this process's)
    c = build_components(cfg, env, device, run_dir, resolved)
    metrics, hooks = c.metrics, c.hooks
    history: list[dict[str, Any]] = []
    skipped = 0  # updates skipped for a non-finite loss or gradient, as the checks learned of them
    nonfinite_steps = NonFiniteSteps(device, cfg.train.check_every, fp16=c.scaler is not None)
    measured_peak = MeasuredPeak(device, c.model, c.optimizer, c.start + 1, cfg.parallel.zero_stage)
    first = FirstStep(c, cfg, env, device)
    goodput = Goodput(started, run_dir, env.is_main, env.world_size, c.start,
                      continuing(cfg.train.resume, c.start), cfg.train.compile)
    with closing(c.sinks), StepProfiler(cfg.profile, run_dir, env.rank, device) as profiler:
        for step in range(c.start + 1, cfg.train.steps + 1):
            goodput.step_started()
            metrics.start_step(step)
            measured_peak.begin(step)
            hooks.step_started(step, metrics.timer.phase)
            loss = forward_backward(c, cfg, step)
            first.after_backward(step)
            last = step == cfg.train.steps
            log_step = step % cfg.train.log_every == 0 or last
            stopping = 0  # the agreed signal number; 0: go on
            with metrics.timer.phase("optimizer"):
                grad_norm = update(c, cfg, nonfinite_steps, step, loss)
                measured_peak.end(step)
                if log_step or c.checkpoints.due(step, last) or step % cfg.train.check_every == 0:
                    WHEREABOUTS.at("check")
                    # sync point: one small all-reduce and host read per check, never on the other steps
                    agreed = agree(c.stop.signum, nonfinite_steps)
                    stopping = agreed.stop
                    if c.scaler is not None:
                        c.scaler.count_backoffs(agreed.overflows)
                    skipped += settle_nonfinite(agreed.events, step, cfg.train.nan_policy)
            sample, ratio = c.wrapped.take_sync_sample(env.world_size, metrics.timer.active)
            metrics.end_step(sample, ratio)
            first.after_step(step, sample, log_step)
            if measured_peak.slows(step) and not log_step:
                metrics.restart_window()  # the CPU memory tracker's step: kept out of throughput, like compilation
            lr = c.scheduler.get_last_lr()[0]
            c.scheduler.step()
            profiler.step()
            WHEREABOUTS.at("after the update")
            hooks.step_ended(step)
            with goodput.blocking("checkpoint"):  # the last save is committed before exit
                saved = c.checkpoints.maybe_save(step, last=last, stop=bool(stopping))
            if stopping:
                goodput.step_ended(step, saved, record=True)
                c.stop.restore()
                raise Stopped(f"stopped by {signal.Signals(stopping).name} after step {step}; checkpoint saved "
                              f"in {c.checkpoints.root}; continue with train.resume=auto", stopping)
            if log_step:
                history.append(log_window(c, cfg, device, step, loss, lr, grad_norm, skipped, goodput))
            goodput.step_ended(step, saved, record=log_step)
        c.stop.restore()
        if cfg.checkpoint.export:
            c.checkpoints.export(run_dir)
        return write_summary(c, cfg, env, device, run_dir, history, first, measured_peak, goodput)  # sinks open


def forward_backward(c: Components, cfg: Config, step: int) -> torch.Tensor:
    """Step ``step``'s micro batches through forward and backward, the gradient sync included; the mean loss."""
    guard = poisoned if c.hooks.poisons_loss(step) else guard_loss
    scale_loss = overflowing(c.scale_loss) if c.hooks.overflows_gradients(step) else c.scale_loss
    try:
        return accumulate_gradients(c.wrapped.module, c.batches, c.shape.grad_accum, c.wrapped.maybe_sync,
                                    c.autocast, c.metrics.timer, c.token_weighted, guard, scale_loss)
    except RuntimeError as exc:
        if cfg.model.checkpoint_reentrant:
            raise reentrant_failure(exc) from exc
        raise


def update(c: Components, cfg: Config, nonfinite_steps: NonFiniteSteps, step: int, loss: torch.Tensor
           ) -> torch.Tensor:
    """Clip and apply the update, skipped on the device (alike on every rank) when the gradients are non-finite;
    returns the gradient norm. No host read here: the non-finite verdict waits for the next check (``loss``,
    this rank's, tells a non-finite loss from an fp16 overflow there).

    A skipped step also drops the compression hook's error feedback on every rank: what top-k or PowerSGD kept
    from a non-finite gradient would otherwise make every later step non-finite too."""
    model = c.model
    if c.scaler is not None:
        c.scaler.unscale(c.optimizer)  # fp16: true gradients before the norm and clipping
    grad_norm = clip_gradients(model, cfg.optim.grad_clip, cfg.parallel.kernels)
    nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank (see guard_loss)
    apply_update(c.optimizer, nonfinite)  # sync point with the foreach / for_loop kernels only
    c.wrapped.step_done(nonfinite)  # sync point with PowerSGD's state only (see parallel/compression.py)
    if c.scaler is not None:
        c.scaler.update()  # fp16: an overflow halves the scale; a non-finite loss is a nan_policy event as well
    nonfinite_steps.record(step, nonfinite, loss)
    return grad_norm


def log_window(c: Components, cfg: Config, device: torch.device, step: int, loss: torch.Tensor, lr: float,
               grad_norm: torch.Tensor, skipped: int, goodput: Goodput) -> dict[str, Any]:
    """A logging step: the window's metrics (validation loss on evaluation steps) to the sinks; returns them."""
    # sync points: the loss mean (an all-reduce), the gradient norm's host read, the straggler gather
    WHEREABOUTS.at("loss mean")
    record = c.metrics.window(step, global_mean(loss), lr, float(grad_norm))
    record["skipped_steps"] = skipped
    if c.scaler is not None:
        record.update(c.scaler.window())
    record.update(c.stragglers.window(record))
    if _every(step, cfg.train.eval_every) or (cfg.train.eval_every and step == cfg.train.steps):
        with goodput.blocking("eval"):
            record["val_loss"] = evaluate(c.model, c.val, c.autocast, device)
    c.sinks.log(record)
    c.metrics.restart_window()
    return record


def write_summary(c: Components, cfg: Config, env: DistEnv, device: torch.device, run_dir: Path,
                  history: list[dict[str, Any]], first: FirstStep, measured_peak: MeasuredPeak,
                  goodput: Goodput) -> dict[str, Any]:
    """The run's summary, with its own predicted step and memory peak and (rank 0) the run's goodput, the last
    figure taken; rank 0 writes ``summary.json``, reports goodput to the sinks and logs it last."""
    summary = summarise(history, c.shape, c.n_params, c.flops_per_token, c.metrics.peak, cfg, first.model_state,
                        c.wrapped.strategy, c.trainable, c.metrics.buckets)
    summary["predicted"].update(predict_own_step(summary, cfg.plan, device.type, env.num_nodes))
    if first.compile_s is not None:
        summary["compile_s"] = first.compile_s
    if c.scaler is not None:
        summary.update(c.scaler.window())  # this rank's final scale and back-offs (the same on every rank)
    if env.is_main:  # a trace of seconds for a small model; every rank plans the same, so rank 0 alone does
        vocab = c.model.get_input_embeddings().weight.shape[0]
        planned = planned_peak(cfg, env.world_size, device, vocab, c.n_params)
        summary["memory_peak"] = memory_peak(planned, measured_peak, cfg.train.steps)
        report = goodput.report()  # the wall-clock ends here
        summary.update(report)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        c.sinks.summary(report)
        log.info("%s", goodput_line(report))
    return summary


def settle_nonfinite(events: list[int], step: int, nan_policy: str) -> int:
    """At a check step: abort, or report the skipped updates (already skipped on every rank); returns their count.

    ``events``: the steps since the last check with a non-finite loss or gradients (fp16: a non-finite loss; an
    overflow from a finite loss is the scaler's back-off). Checks come before every checkpoint, so an aborted run
    never saves a state after its non-finite step.
    """
    count, first = len(events), events[0] if events else 0
    if count and nan_policy == "abort":
        raise NonFiniteError(f"non-finite loss or gradients at step {first} (train.nan_policy=abort); "
                             "no checkpoint was written for it")
    if count:
        more = f" and {count - 1} more up to step {step}" if count > 1 else ""
        log.warning("non-finite loss or gradients at step %d%s: update skipped on every rank", first, more)
    return count


def _every(step: int, period: int) -> bool:
    """True every ``period`` steps; never when the period is 0 (disabled)."""
    return period > 0 and step % period == 0
