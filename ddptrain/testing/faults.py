"""Fault injection for the reliability tests, driven by ``DDPTRAIN_FAULT``: step hooks that kill, hang, poison or
delay one rank at one point.

Format ``KIND@POINT:STEP[:RANK]``: KIND is kill (SIGKILL this process), hang (stop making progress), nan
(poison this rank's loss), overflow (scale this rank's loss by 2**100 before backward: its gradients overflow
fp16 while the loss stays finite, as after a loss scale that grew too far) or mismatch (call one extra
all-reduce of 3 floats, which no other rank calls); POINT is ``step`` (after optimizer step STEP) or ``save``
(while the checkpoint of STEP is half written, before its commit); a hang may also be in ``data`` or
``forward`` (inside that phase of step STEP). RANK defaults to 0.
Example: ``DDPTRAIN_FAULT=kill@save:6``.
The fault fires only in the first attempt of a run (``TORCHELASTIC_RESTART_COUNT`` 0), so restarts recover.

A straggler: ``delay@PHASE:STEP:RANK[:MS]`` sleeps MS milliseconds (default 200) in PHASE (``data`` or
``forward``) of every step from STEP on, on RANK only. Example: ``DDPTRAIN_FAULT=delay@data:1:1``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ddptrain.runtime.hooks import StepHooks


def step_hooks(rank: int) -> StepHooks:
    """This rank's hooks: the fault ``DDPTRAIN_FAULT`` names in a run's first attempt, else none."""
    spec = os.environ.get("DDPTRAIN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return StepHooks()
    kind, _, where = spec.partition("@")
    point, step, *rest = where.split(":")
    target = int(rest[0]) if rest else 0
    if target != rank:
        return StepHooks()
    return Fault(kind, point, int(step), float(rest[1]) if len(rest) > 1 else 200.0)


@dataclass(frozen=True)
class Fault(StepHooks):
    """One fault on this rank: ``kind`` at ``point`` of ``step`` (a delay: of every step from ``step`` on)."""

    kind: str
    point: str
    step: int
    delay_ms: float = 200.0

    def step_started(self, step: int, phase: Callable[[str], AbstractContextManager]) -> None:
        """A hang in ``data`` or ``forward`` of its step; a delay there in every step from its step on."""
        if self.kind == "hang" and self.point in ("data", "forward") and step == self.step:
            with phase(self.point):
                _hang()
        if self.kind == "delay" and step >= self.step:
            with phase(self.point):
                time.sleep(self.delay_ms / 1e3)

    def poisons_loss(self, step: int) -> bool:
        return self.kind == "nan" and step == self.step

    def overflows_gradients(self, step: int) -> bool:
        return self.kind == "overflow" and step == self.step

    def step_ended(self, step: int) -> None:
        self._strike("step", step)

    def before_commit(self, step: int) -> None:
        self._strike("save", step)  # a crash while the write is in flight must leave the previous checkpoint

    def _strike(self, point: str, step: int) -> None:
        """Kill, hang or call a collective no other rank calls, if this is the fault's point and step."""
        if (point, step) != (self.point, self.step):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            _hang()
        if self.kind == "mismatch":
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(3))


def _hang() -> None:
    while True:
        time.sleep(1)
