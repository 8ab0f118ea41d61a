"""What a rank leaves in ``<run dir>/hang/`` so that a hang or a death can be named afterwards.

- ``rank{r}.where``: the rank's step and phase, always current (``whereabouts``), readable after a SIGKILL.
- ``rank{r}.stacks``: Python stacks of every thread, written by ``faulthandler`` on a fatal signal (SIGSEGV,
  SIGABRT: gloo aborts a rank whose collective's size differs from its peers'), and on a collective timeout or
  the launcher's SIGTERM.
- ``rank{r}.json``: on a collective timeout or SIGTERM: step, phase, the innermost ddptrain frame, the error,
  and the last collectives of the default process group from torch's flight recorder (``dist.flight_recorder``
  entries; gloo and NCCL both record).

The launcher reads them after a failure (``diagnose.verdict``) and prints one sentence.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from ddptrain.diagnose.whereabouts import WHEREABOUTS

log = logging.getLogger(__name__)
HANG_DIR = "hang"
TIMED_OUT = "collective timed out"  # the reason a rank records when one of its collectives timed out or lost a peer
FLIGHT_RECORDS = 8  # collectives kept in a rank's record (the flight recorder's own buffer is larger)
_PACKAGE = Path(__file__).resolve().parents[1]
_NOT_WHERE = (_PACKAGE / "testing", _PACKAGE / "diagnose")  # fault injection and this package are never "where"
_LOST_PEER = re.compile(r"timed out|timeout|connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
          "Byte": 1, "Bool": 1}


def enable_flight_recorder(entries: int) -> None:
    """Turn on torch's flight recorder for the process groups created from now on (``dist.flight_recorder``)."""
    if entries > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


class Evidence:
    """This rank's evidence files; installed once per worker, after the run dir is known."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.dir = run_dir / HANG_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{rank}.json").unlink(missing_ok=True)  # a previous attempt's
        self._stacks: IO[str] = (self.dir / f"rank{rank}.stacks").open("w")
        faulthandler.enable(self._stacks, all_threads=True)
        WHEREABOUTS.open(self.dir / f"rank{rank}.where")
        self._recorded = False
        global _ACTIVE
        _ACTIVE = self
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Before the training loop installs its own stop handler: record, then die of the signal as before."""
        self.record("SIGTERM from the launcher", frame=frame)
        signal.signal(signum, self._previous if callable(self._previous) else signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def record(self, reason: str, error: BaseException | None = None, frame: FrameType | None = None) -> None:
        """Write this rank's record and every thread's stack (once per process: the first cause is the one)."""
        if self._recorded:
            return
        self._recorded = True
        where = innermost(error.__traceback__ if error is not None else None, frame)
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "reason": reason, "error": _first_line(error) if error is not None else None,
                  "step": WHEREABOUTS.step, "phase": WHEREABOUTS.phase, "where": where,
                  "collectives": flight_record()}
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(record) + "\n")
        self._stacks.write(f"\n--- {reason}: every thread's stack ---\n")
        self._stacks.flush()
        faulthandler.dump_traceback(self._stacks, all_threads=True)
        self._stacks.flush()

    def lost_peer(self, error: BaseException) -> dict[str, Any] | None:
        """For a collective that timed out or lost its peer: record it and return the record; else None."""
        if not _LOST_PEER.search(str(error)):
            return None
        self.record(TIMED_OUT, error)
        return json.loads((self.dir / f"rank{self.rank}.json").read_text())


def record_evidence(reason: str, frame: FrameType | None = None) -> None:
    """Record this rank's evidence now (the stop handler calls it on SIGTERM); nothing when none is installed."""
    if _ACTIVE is not None:
        _ACTIVE.record(reason, frame=frame)


_ACTIVE: Evidence | None = None


def innermost(tb: TracebackType | None, frame: FrameType | None) -> str | None:
    """``path:line`` of the innermost ddptrain frame (not fault injection's) of a traceback, or of a frame's
    stack (the main thread's, when neither is given)."""
    frames: list[tuple[FrameType, int]] = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        frame = frame or sys._current_frames().get(threading.main_thread().ident or 0)
        while frame is not None:
            frames.insert(0, (frame, frame.f_lineno))
            frame = frame.f_back
    for f, line in reversed(frames):
        path = Path(f.f_code.co_filename).resolve()
        if path.is_relative_to(_PACKAGE) and not any(path == p or path.is_relative_to(p) for p in _NOT_WHERE):
            return f"{path.relative_to(_PACKAGE.parent)}:{line}"
    return None


def flight_record() -> list[dict[str, Any]]:
    """The last collectives of the default process group that torch's flight recorder holds (empty when off)."""
    try:
        import torch

        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    except Exception:  # noqa: BLE001 - no recorder (off, or a build without it): no entries, not an error
        return []
    entries = [e for e in trace.get("entries", []) if tuple(e.get("process_group", ()))[:1] == ("0",)]
    out = []
    for e in entries[-FLIGHT_RECORDS:]:
        sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
        nbytes = sum(_numel(s) * _BYTES.get(d, 4) for s, d in zip(sizes, dtypes, strict=False))
        out.append({"seq": e.get("collective_seq_id"), "op": str(e.get("profiling_name", "")).split(":")[-1],
                    "sizes": sizes, "bytes": nbytes})
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
