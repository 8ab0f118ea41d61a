"""Where each rank is (step and phase), kept in a small memory-mapped file that outlives the process.

A phase change is a write into mapped memory (no system call), so it costs nothing measurable per step, and
the kernel keeps the page when the process is SIGKILLed: the launcher still reads where a dead rank was.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_RECORD = struct.Struct("<q32s")  # step, phase (UTF-8, NUL padded)


class Whereabouts:
    """This rank's step and phase; does nothing until ``open`` gives it a file."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "start-up"
        self._map: mmap.mmap | None = None

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb+") as stream:
            stream.write(b"\0" * _RECORD.size)
            stream.flush()
            self._map = mmap.mmap(stream.fileno(), _RECORD.size)
        self._write()

    def close(self) -> None:
        """Stop writing to the file (its owner removes it); later phases are kept in memory only."""
        if self._map is not None:
            self._map.close()
            self._map = None

    def at(self, phase: str, step: int | None = None) -> None:
        """Record that this rank entered ``phase`` (of ``step``, when given)."""
        if step is not None:
            self.step = step
        self.phase = phase
        if self._map is not None:
            self._write()

    def _write(self) -> None:
        assert self._map is not None
        self._map[:] = _RECORD.pack(self.step, self.phase.encode()[:32])


def read_whereabouts(path: Path) -> tuple[int, str] | None:
    """(step, phase) a rank last recorded in ``path``; None when it never wrote one."""
    try:
        step, phase = _RECORD.unpack(path.read_bytes()[: _RECORD.size])
    except (OSError, struct.error):
        return None
    return step, phase.rstrip(b"\0").decode(errors="replace")


WHEREABOUTS = Whereabouts()  # this process's; the step timer and the loop report into it
