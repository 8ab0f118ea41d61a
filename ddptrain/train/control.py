"""Decisions every rank must take alike: stop on SIGTERM/SIGINT, and what to do with a non-finite step."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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
        log.warning("%s received: stopping at the next step boundary", signal.Signals(signum).name)
        watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def agree(stop_requested: bool, nonfinite: bool, device: torch.device) -> tuple[bool, bool]:
    """One small all-reduce per step: does any rank want to stop, did any rank see a non-finite value."""
    flags = torch.tensor([float(stop_requested), float(nonfinite)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])
