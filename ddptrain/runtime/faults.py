"""Fault injection for the reliability tests, driven by ``DDPTRAIN_FAULT``; does nothing when it is unset.

Format ``KIND@POINT:STEP[:RANK]``: KIND is kill (SIGKILL this process), hang (stop making progress), nan
(poison this rank's loss) or mismatch (call one extra all-reduce of 3 floats, which no other rank calls);
POINT is ``step`` (after optimizer step STEP) or ``save`` (while the checkpoint of STEP is half written, before
its commit); a hang may also be in ``data`` or ``forward`` (inside that phase of step STEP). RANK defaults to 0.
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


def _fault() -> tuple[str, str, int, int, float] | None:
    """(kind, point, step, rank, milliseconds) of ``DDPTRAIN_FAULT``, or None."""
    spec = os.environ.get("DDPTRAIN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    kind, _, where = spec.partition("@")
    point, step, *rest = where.split(":")
    return kind, point, int(step), int(rest[0]) if rest else 0, float(rest[1]) if len(rest) > 1 else 200.0


def inject(point: str, step: int, rank: int) -> None:
    """Kill or hang here if ``DDPTRAIN_FAULT`` names this point, step and rank."""
    fault = _fault()
    if fault is None or fault[1:4] != (point, step, rank):
        return
    if fault[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault[0] == "hang":
        _hang()
    if fault[0] == "mismatch":
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(3))


def _hang() -> None:
    while True:
        time.sleep(1)


def poison_loss(step: int, rank: int) -> bool:
    """True when this rank's loss of ``step`` must become NaN."""
    fault = _fault()
    return fault is not None and fault[0] == "nan" and fault[2:4] == (step, rank)


def delay(step: int, rank: int, phase: Callable[[str], AbstractContextManager]) -> None:
    """Sleep inside ``phase(PHASE)`` (the step timer's) if a ``delay`` fault names this rank and a step <= ``step``;
    hang there if a ``hang@data`` or ``hang@forward`` fault names this rank and step."""
    fault = _fault()
    if fault is None or fault[3] != rank:
        return
    if fault[0] == "hang" and fault[1] in ("data", "forward") and step == fault[2]:
        with phase(fault[1]):
            _hang()
    if fault[0] != "delay" or step < fault[2]:
        return
    with phase(fault[1]):
        time.sleep(fault[4] / 1e3)
