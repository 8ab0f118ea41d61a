"""Everything that watches a step rather than computes it, behind one object the loop calls at a few named points.

``StepObserver`` holds the step timer and metrics, the gradient-sync sample, the measured memory peak, the first
step's one-off measurements, goodput's wall-clock accounting, the profiler and the step hooks (fault injection
when a test asks for it). A step reads::

    started(step) -> [forward/backward, phases timed] -> after_backward -> [update] -> after_update
    -> after_step(step, log_step) -> [checkpoint, in blocking("checkpoint")] -> after_save

None of these reads the device back on a steady step: the timer synchronises on its sampled steps only
(``metrics.sample_every``), the first step's measurements once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType

import torch

from ddptrain.diagnose.whereabouts import WHEREABOUTS
from ddptrain.step.control import guard_loss, overflowing, poisoned
from ddptrain.telemetry.goodput import Goodput, continuing
from ddptrain.telemetry.measured_peak import MeasuredPeak
from ddptrain.telemetry.profile import StepProfiler
from ddptrain.train.first_step import FirstStep
from ddptrain.train.view import TrainerView

LossFn = Callable[[torch.Tensor], torch.Tensor]


class StepObserver:
    """The loop's one handle on instrumentation; a context manager around the loop (the profiler's span)."""

    def __init__(self, t: TrainerView, started: float) -> None:
        """``started``: goodput's wall-clock start of this attempt (the launcher's, or this process's)."""
        cfg = t.cfg
        self.t = t
        self.metrics, self.hooks = t.metrics, t.hooks
        self.peak = MeasuredPeak(t.device, t.model, t.optimizer, t.start + 1, cfg.parallel.zero_stage)
        self.first = FirstStep(t)
        self.goodput = Goodput(started, t.run_dir, t.env.is_main, t.env.world_size, t.start,
                               continuing(cfg.train.resume, t.start), cfg.train.compile)
        self.profiler = StepProfiler(cfg.profile, t.run_dir, t.env.rank, t.device)

    def __enter__(self) -> StepObserver:
        self.profiler.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.profiler.__exit__(kind, exc, tb)

    def started(self, step: int) -> None:
        """Before step ``step`` reads its data."""
        self.goodput.step_started()
        self.metrics.start_step(step)
        self.peak.begin(step)
        self.hooks.step_started(step, self.phase)

    def phase(self, name: str) -> AbstractContextManager:
        """A timed phase of the step ("data", "forward", "backward", "optimizer")."""
        return self.metrics.timer.phase(name)

    def loss_guard(self, step: int) -> LossFn:
        """What each micro batch's loss passes through: ``guard_loss``, or a NaN where fault injection poisons it."""
        return poisoned if self.hooks.poisons_loss(step) else guard_loss

    def scale_loss(self, step: int, scale: LossFn) -> LossFn:
        """The backward's loss scaling (fp16's, else none), overflowing where fault injection asks for it."""
        return overflowing(scale) if self.hooks.overflows_gradients(step) else scale

    def after_backward(self, step: int) -> None:
        self.first.after_backward(step)

    def after_update(self, step: int) -> None:
        """After the update, before a check step's agreement: what the hooks do to the parameters lands before it."""
        self.peak.end(step)
        self.hooks.update_done(step, self.t.model)

    def after_step(self, step: int, log_step: bool) -> None:
        """After the update and the learning rate's step, before the checkpoint: the step's timing and sync sample,
        the first step's measurements, the profiler's step and the hooks' step end."""
        t = self.t
        sample, ratio = t.wrapped.take_sync_sample(t.env.world_size, self.metrics.timer.active)
        self.metrics.end_step(sample, ratio)
        self.first.after_step(step, sample, log_step)
        if self.peak.slows(step) and not log_step:
            self.metrics.restart_window()  # the CPU memory tracker's step: kept out of throughput, like compilation
        self.profiler.step()
        WHEREABOUTS.at("after the update")
        self.hooks.step_ended(step)

    @contextmanager
    def blocking(self, bucket: str) -> Iterator[None]:
        """Wall-clock that goodput books to ``bucket`` ("checkpoint", "eval") rather than to training."""
        with self.goodput.blocking(bucket):
            yield

    def after_save(self, step: int, saved: bool, record: bool) -> None:
        """The step is over (its checkpoint ``saved`` or not); ``record``: goodput writes its accounting now."""
        self.goodput.step_ended(step, saved, record=record)
