"""The training loop: build once, then per step train (``train_step``), log, evaluate, save; export and summarise
at the end.

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
from ddptrain.plan.memory.own_peak import memory_peak, planned_peak
from ddptrain.plan.whatif.own_run import predict_own_step
from ddptrain.runtime.process_group import DistEnv
from ddptrain.telemetry.goodput import attempt_start, goodput_line
from ddptrain.train.components import Trainer, build_trainer
from ddptrain.train.control import Stopped
from ddptrain.train.observer import StepObserver
from ddptrain.train.step import Stepped, evaluate, global_mean, train_step
from ddptrain.train.summary import summarise

log = logging.getLogger("ddptrain")


def train(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank (every rank runs this alike); returns the run's summary, which rank 0 also writes to
    ``summary.json``."""
    started = attempt_start()  # goodput's wall-clock: this attempt's start (the launcher's, or this process's)
    t = build_trainer(cfg, env, device, run_dir, resolved)
    history: list[dict[str, Any]] = []
    skipped = 0  # updates skipped for a non-finite loss or gradient, as the checks learned of them
    with closing(t.sinks), StepObserver(t, started) as watch:
        for step in range(t.start + 1, cfg.train.steps + 1):
            last = step == cfg.train.steps
            log_step = step % cfg.train.log_every == 0 or last
            check = log_step or t.checkpoints.due(step, last) or step % cfg.train.check_every == 0
            watch.started(step)
            done = train_step(t, watch, step, check)
            skipped += done.skipped
            watch.after_step(step, log_step)
            with watch.blocking("checkpoint"):  # the last save is committed before exit
                saved = t.checkpoints.maybe_save(step, last=last, stop=bool(done.stop))
            if done.stop:
                watch.after_save(step, saved, record=True)
                t.stop.restore()
                raise Stopped(f"stopped by {signal.Signals(done.stop).name} after step {step}; checkpoint saved "
                              f"in {t.checkpoints.root}; continue with train.resume=auto", done.stop)
            if log_step:
                history.append(log_window(t, watch, step, done, skipped))
            watch.after_save(step, saved, record=log_step)
        t.stop.restore()
        if cfg.checkpoint.export:
            t.checkpoints.export(run_dir)
        return write_summary(t, watch, history)  # sinks open


def log_window(t: Trainer, watch: StepObserver, step: int, done: Stepped, skipped: int) -> dict[str, Any]:
    """A logging step: the window's metrics (validation loss on evaluation steps) to the sinks; returns them."""
    cfg = t.cfg
    # sync points: the loss mean (an all-reduce), the gradient norm's host read, the straggler gather
    WHEREABOUTS.at("loss mean")
    record = t.metrics.window(step, global_mean(done.loss), done.lr, float(done.grad_norm))
    record["skipped_steps"] = skipped
    if t.scaler is not None:
        record.update(t.scaler.window())
    record.update(t.stragglers.window(record))
    if _every(step, cfg.train.eval_every) or (cfg.train.eval_every and step == cfg.train.steps):
        with watch.blocking("eval"):
            record["val_loss"] = evaluate(t.model, t.val, t.autocast, t.device)
    t.sinks.log(record)
    t.metrics.restart_window()
    return record


def write_summary(t: Trainer, watch: StepObserver, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary, with its own predicted step and memory peak and (rank 0) the run's goodput, the last
    figure taken; rank 0 writes ``summary.json``, reports goodput to the sinks and logs it last. Returns the
    summary's JSON record."""
    cfg, env, first = t.cfg, t.env, watch.first
    summary = summarise(history, t, first.model_state)
    summary.predicted.update(predict_own_step(summary, cfg.plan, t.device.type, env.num_nodes))
    summary.compile_s = first.compile_s
    if t.scaler is not None:
        summary.loss_scale = t.scaler.window()  # this rank's final scale and back-offs (the same on every rank)
    if env.is_main:  # a trace of seconds for a small model; every rank plans the same, so rank 0 alone does
        vocab = t.model.get_input_embeddings().weight.shape[0]
        planned = planned_peak(cfg, env.world_size, t.device, vocab, t.n_params)
        summary.memory_peak = memory_peak(planned, watch.peak, cfg.train.steps)
        summary.goodput = watch.goodput.report()  # the wall-clock ends here
        record = summary.to_json()
        (t.run_dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
        t.sinks.summary(summary.goodput)
        log.info("%s", goodput_line(summary.goodput))
        return record
    return summary.to_json()


def _every(step: int, period: int) -> bool:
    """True every ``period`` steps; never when the period is 0 (disabled)."""
    return period > 0 and step % period == 0
