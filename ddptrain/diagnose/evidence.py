"""What a rank leaves in ``<run dir>/hang/`` so that a hang or a death can be named afterwards.

- ``rank{r}.where``: the rank's step and phase, always current (``whereabouts``), readable after a SIGKILL.
- ``rank{r}.stacks``: Python stacks of every thread, written by ``faulthandler`` on a fatal signal (SIGSEGV,
  SIGABRT: gloo aborts a rank whose collective's size differs from its peers'), and on a collective timeout or
  the launcher's SIGTERM.
- ``rank{r}.json``: on a collective timeout or SIGTERM: step, phase, the innermost ddptrain frame, the error,
  and every collective of the training's process groups that torch's flight recorder holds, with each group's
  global ranks (``diagnose.trace``; gloo and NCCL both record, NCCL into its own trace).
- ``nccl_trace_rank_{r}``: on NCCL, torch's own flight-recorder dump, written by NCCL's watchdog when a collective
  times out (on this rank, or on another that signalled it). NCCL's collectives return at enqueue and its
  watchdog aborts a waiting rank (SIGABRT from a native thread, no Python exception), so a waiting rank writes
  no ``rank{r}.json``: this dump is what says it was waiting, and in which collective.

The launcher reads them after a failure (``diagnose.verdict``) and prints one sentence.
"""

from __future__ import annotations

import contextlib
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

from ddptrain.diagnose.trace import Trace, read_trace
from ddptrain.diagnose.whereabouts import WHEREABOUTS

log = logging.getLogger(__name__)
HANG_DIR = "hang"
TIMED_OUT = "collective timed out"  # the reason a rank records when one of its collectives timed out or lost a peer
NCCL_DUMP = "nccl_trace_rank_"  # + global rank: torch's dump file name is a prefix and the rank
# torch's variables for the dump's file prefix: the current name first, then the older one it still reads
_DUMP_PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_PACKAGE = Path(__file__).resolve().parents[1]
_NOT_WHERE = (_PACKAGE / "testing", _PACKAGE / "diagnose")  # fault injection and this package are never "where"
_LOST_PEER = re.compile(r"timed out|timeout|connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


def enable_flight_recorder(entries: int | None) -> None:
    """``dist.flight_recorder``, before the process group exists (torch reads the variables when it creates the
    recorder, once per process): None leaves torch's ring as the environment sets it (``TORCH_FR_BUFFER_SIZE``,
    else torch's default of 2000 entries) and NCCL's dump on a timeout on; N > 0 sets the ring to N entries (it
    is one ring for the whole process, every group's collectives in it: fewer than the default can lose a
    waiting rank's collective); 0 turns the recorder and NCCL's dump off."""
    if entries is None:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        return
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1" if entries > 0 else "0"


_POINTED: set[str] = set()  # the prefixes this process pointed the dump to: an earlier run's here, not the user's


def nccl_dump_prefix(hang_dir: Path) -> str:
    """Where NCCL's watchdog dumps each rank's flight recorder (the file is this prefix + the global rank): the
    user's ``TORCH_FR_DUMP_TEMP_FILE`` (or the older ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``), else ``hang_dir``."""
    for var in _DUMP_PREFIX_VARS:
        value = os.environ.get(var)
        if value and value not in _POINTED:
            return value
    return str(hang_dir / NCCL_DUMP)


def point_nccl_dump(hang_dir: Path, rank: int) -> None:
    """Point NCCL's dump into ``hang_dir`` unless the user pointed it elsewhere, and remove this rank's dump of a
    previous attempt. torch reads the prefix when it first dumps (at a timeout), not when the group is created,
    so setting it once the run dir is known works."""
    prefix = nccl_dump_prefix(hang_dir)
    Path(f"{prefix}{rank}").unlink(missing_ok=True)
    if prefix == str(hang_dir / NCCL_DUMP):
        _POINTED.add(prefix)
    for var in _DUMP_PREFIX_VARS:
        os.environ[var] = prefix


class Evidence:
    """This rank's evidence files; installed once per worker, after the run dir is known."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.dir = run_dir / HANG_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{rank}.json").unlink(missing_ok=True)  # a previous attempt's
        point_nccl_dump(self.dir, rank)
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
                  "step": WHEREABOUTS.step, "phase": WHEREABOUTS.phase, "where": where, **flight_record()}
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(record) + "\n")
        self._stacks.write(f"\n--- {reason}: every thread's stack ---\n")
        self._stacks.flush()
        faulthandler.dump_traceback(self._stacks, all_threads=True)
        self._stacks.flush()

    def discard(self) -> None:
        """This rank ended without hanging or dying (a healthy run, a refusal, an end on purpose): its files, which
        recorded nothing, are removed, and ``hang/`` with them once every rank's are gone. Evidence that was
        recorded is kept."""
        if self._recorded:
            return
        global _ACTIVE
        if _ACTIVE is self:  # a later signal in this process (an in-process run ended) has no hang/ to write into
            _ACTIVE = None
        faulthandler.disable()
        self._stacks.close()
        WHEREABOUTS.close()
        for name in (f"rank{self.rank}.stacks", f"rank{self.rank}.where"):
            (self.dir / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another rank's files, or a user's, are still there
            self.dir.rmdir()

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


def flight_record() -> Trace:
    """Every collective of the training's process groups that torch's flight recorder holds, and each group's
    global ranks (empty when the recorder is off).

    NCCL records into its own trace (``_dump_nccl_trace``, in a CUDA build of torch), gloo into the other
    (``_dump_fr_trace``); the NCCL trace is read when it holds any training collective.
    """
    import torch

    c10d = torch._C._distributed_c10d
    for dump, nccl in ((getattr(c10d, "_dump_nccl_trace", None), True), (getattr(c10d, "_dump_fr_trace", None), False)):
        if dump is None:
            continue
        try:  # without stack traces: a record keeps none, and collecting them for a full ring takes time
            found = read_trace(pickle.loads(dump(True, False, False)), nccl)
        except Exception:  # noqa: BLE001 - no recorder (off, or a build without it): no entries, not an error
            continue
        if found["collectives"]:
            _add_group_ranks(found)
            return found
    return {"collectives": [], "groups": {}}


def _add_group_ranks(trace: Trace) -> None:
    """Each group's global ranks where the dump left them out (gloo's dump has no ``pg_config``): from this
    process's own groups. ``_get_all_pg_configs`` is private to torch; without it the verdict takes a group's
    ranks from the ranks that recorded its collectives."""
    try:
        from torch.distributed import distributed_c10d

        configs = distributed_c10d._get_all_pg_configs()
    except Exception:  # noqa: BLE001 - an older or newer torch, or no process group: the fallback above
        return
    for config in configs:
        group = trace["groups"].get(str(config.get("pg_name")))
        if group is not None and group.get("ranks") is None:
            group["ranks"] = [int(r) for r in config.get("ranks") or []] or None


def read_nccl_dump(path: Path) -> Trace | None:
    """The training groups' collectives in NCCL's dump at ``path``; None when there is none or it cannot be read.
    The dump is a pickle of plain dicts, lists and strings: it is read without running code from it."""
    try:
        with path.open("rb") as stream:
            trace = _PlainUnpickler(stream).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return None
    return read_trace(trace, nccl=True) if isinstance(trace, dict) else None


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every class and function: a flight-recorder dump holds only plain values."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
