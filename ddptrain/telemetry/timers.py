"""Where a step's time goes: data wait, forward, backward compute, exposed communication, optimizer.

A wrapper's own work at the start of forward (DDP's buffer broadcast: a collective, so time spent waiting for
the slowest rank) is split off as ``forward_sync`` when the wrapped model reports its own start
(``inner_forward_started``).

Host clock (perf_counter). On CUDA a sampled step synchronizes the device at each phase boundary so the
host clock sees the device's work (two per phase: 28 in a step of 4 micro-steps); that is why timing is
sampled every ``metrics.sample_every`` steps, by default every step on the CPU (where it costs nothing) and every
``CUDA_SAMPLE_EVERY`` steps on CUDA, the other steps running unsynchronized.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ddptrain.diagnose.whereabouts import WHEREABOUTS

CUDA_SAMPLE_EVERY = 10  # the default on CUDA: one synchronized step per default logging window

log = logging.getLogger(__name__)


def device_clock(device: torch.device) -> float:
    """The host clock once the device's queued work is done (a synchronize on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepTimer:
    """Accumulates phase durations over the sampled steps of one logging window."""

    def __init__(self, device: torch.device, sample_every: int | None) -> None:
        self.device = device
        if sample_every is None:
            sample_every = CUDA_SAMPLE_EVERY if device.type == "cuda" else 1
        self.sample_every = max(1, sample_every)
        if device.type == "cuda":
            log.info("step breakdown timed every %d steps (metrics.sample_every), synchronizing the device at each "
                     "phase boundary; the other steps run unsynchronized", self.sample_every)
        self.active = False
        self.totals: dict[str, float] = defaultdict(float)
        self.sampled_steps = 0
        self._step_start = 0.0
        self._inner_start: float | None = None  # when the wrapped model's own forward began, this phase

    def now(self) -> float:
        return device_clock(self.device) if self.active else time.perf_counter()

    def start_step(self, step: int) -> None:
        WHEREABOUTS.at("step start", step)
        self.active = step % self.sample_every == 0
        if self.active:
            self._step_start = self.now()

    def end_step(self) -> None:
        if self.active:
            self.totals["step"] += self.now() - self._step_start
            self.sampled_steps += 1
            self.active = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        WHEREABOUTS.at(name)  # where this rank is, for naming a hang (a write to mapped memory)
        if not self.active:
            yield
            return
        start = self.now()
        self._inner_start = None
        yield
        end = self.now()
        if name == "forward" and self._inner_start is not None:
            self.totals["forward_sync"] += self._inner_start - start
            start = self._inner_start
        self.totals[name] += end - start

    def inner_forward_started(self) -> None:
        """Called by a forward pre-hook on the wrapped model: what came before was the wrapper's sync."""
        if self.active:
            self._inner_start = self.now()

    def add(self, name: str, seconds: float) -> None:
        if self.active:
            self.totals[name] += seconds

    def window(self) -> dict[str, float]:
        """Mean seconds per sampled step of each phase since the last call; then start a new window."""
        n = self.sampled_steps
        out = {f"time_{k}_s": v / n for k, v in self.totals.items()} if n else {}
        self.totals.clear()
        self.sampled_steps = 0
        return out
