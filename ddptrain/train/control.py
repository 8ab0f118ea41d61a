"""Decisions every rank must take alike: stop on SIGTERM/SIGINT, and what to do with a non-finite step.

A steady step reads nothing back to the host. A rank's non-finite loss poisons its gradients (``guard_loss``),
so the gradient collective that follows carries it to every rank; each step's verdict stays on the device
(``NonFiniteSteps``) and the ranks agree on it, and on stop requests, only at check steps (``agree``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from ddptrain.diagnose.evidence import record_evidence
from ddptrain.errors import RunEnded

log = logging.getLogger(__name__)


class Stopped(RunEnded):
    """A requested stop (SIGTERM/SIGINT) completed: the checkpoint is safe, the process exits 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, 128 + signum)


class NonFiniteError(RunEnded):
    """train.nan_policy=abort met a non-finite loss or gradient (decided alike on every rank)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 3)


class StopRequest:
    """SIGTERM or SIGINT asks for a stop at the next step boundary (checkpoint, then exit).

    Preemption gives a short grace: a rank that cannot reach a boundary (stuck in a hang) exits on its own
    after ``grace_s`` instead of waiting for the launcher's SIGKILL.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            return
        self.signum = signum
        record_evidence(f"{signal.Signals(signum).name} from the launcher", frame)  # in case the stop never comes
        log.warning("%s received: stopping at the next step boundary", signal.Signals(signum).name)
        watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def guard_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` itself when finite; else NaN, whose gradients are NaN too.

    A non-finite loss can still have finite gradients (an infinite cross-entropy, a poisoned value); this turns
    it into non-finite gradients, which the gradient all-reduce (or FSDP2's reduce-scatter) then spreads to
    every rank: the flag rides on a collective that happens anyway. ``loss * 1.0`` is exact, so finite steps
    are bit-for-bit unchanged.
    """
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The loss of a step that fault injection poisons: NaN, before backward, as a real non-finite loss is."""
    return guard_loss(loss * math.nan)


class NonFiniteSteps:
    """Non-finite steps since the last check, counted on the device so that a step need not read them back.

    A step's verdict is ``not isfinite(grad_norm)``: the same on every rank, since the synced gradients carry
    every rank's non-finite loss (``guard_loss``) and FSDP2's norm is reduced over all shards.
    """

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.float64, device=device)  # non-finite steps since the last check
        self.first = torch.zeros((), dtype=torch.float64, device=device)  # the first of them; 0 when none

    def record(self, nonfinite: torch.Tensor, step: int) -> None:
        self.first.copy_(torch.where(nonfinite & (self.count == 0), float(step), self.first))
        self.count += nonfinite

    def reset(self) -> None:
        self.count.zero_()
        self.first.zero_()


def agree(signum: int, nonfinite: NonFiniteSteps) -> tuple[int, int, int]:
    """A check step: the signal that asks some rank to stop (0: none); the non-finite steps since the last check,
    and the first of them.

    Every rank learns the signal, also those the launcher did not signal, so all exit 128 + that signal.
    One small all-reduce and one host read (a sync point), once per check rather than once per step.
    """
    stop = torch.tensor(float(signum), dtype=torch.float64, device=nonfinite.count.device)
    flags = torch.stack([stop, nonfinite.count, nonfinite.first])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stopping, count, first = flags.tolist()  # sync point: the host learns the agreed flags here
    nonfinite.reset()
    return int(stopping), int(count), int(first)


