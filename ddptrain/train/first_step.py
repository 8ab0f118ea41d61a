"""What a run does once, on its first step (the first after a resume too): read the model state's peak around it,
time compilation, log the trainable-parameters line and gather every rank's model state.

The step observer (``train/observer.py``) calls ``after_backward`` and ``after_step`` on every step; both act on
the first step only.
"""

from __future__ import annotations

import logging
from typing import Any

from ddptrain.config.choices import Precision
from ddptrain.models.lora import trainable_line
from ddptrain.parallel.zero import shard_group_size
from ddptrain.plan.costs import FP32, MIXED_BF16
from ddptrain.telemetry.comm import SyncSample
from ddptrain.telemetry.timers import device_clock
from ddptrain.train.summary import report_model_state
from ddptrain.train.view import TrainerView

log = logging.getLogger("ddptrain")


class FirstStep:
    """The first step's one-off measurements; ``compile_s`` and ``model_state`` go into the summary."""

    def __init__(self, t: TrainerView) -> None:
        self.t = t
        self.step = t.start + 1
        self.compile_s: float | None = None  # train.compile: the first step's seconds, compilation included
        self.model_state: dict[str, Any] = {}  # the model state every rank measured, against the plan
        self._started = device_clock(t.device)  # sync point (CUDA): once, so the first step's time is its own

    def after_backward(self, step: int) -> None:
        if step == self.step:
            self.t.probe.after_backward()

    def after_step(self, step: int, sample: SyncSample | None, log_step: bool) -> None:
        """After the update and its timing; ``sample``: the step's gradient-sync sample (its payload is logged)."""
        if step != self.step:
            return
        t, cfg, env = self.t, self.t.cfg, self.t.env
        if cfg.train.compile:
            self.compile_s = device_clock(t.device) - self._started  # sync point (CUDA): the first step only
            log.info("train.compile: first step %.1f s, compilation included (kept out of throughput)",
                     self.compile_s)
            if not log_step:
                t.metrics.restart_window()
        # the compressed payload, as the logged comm_bytes will show it, not a late-starting compression's warm-up
        log.info("%s", trainable_line(t.trainable, t.n_params, sample.compressed_bytes if sample else None,
                                      sample.payload_bytes if sample else None))
        t.probe.after_step(t.optimizer)
        # sync point: every rank's measured model state is gathered, once
        self.model_state = report_model_state(
            t.probe, t.n_params, env.world_size, cfg.parallel.zero_stage,
            shard_group_size(cfg.parallel, env.world_size, env.local_world_size),
            MIXED_BF16 if t.precision == Precision.bf16 else FP32, t.trainable)
