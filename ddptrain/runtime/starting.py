"""What start-up is doing now: said on the console as each long part begins, and named if the run is
interrupted (Ctrl-C) there, so the one line the command then prints says what was interrupted and what is safe."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("ddptrain")
# the data cache after an interrupted preparation: shards are committed whole, a finished entry by its DONE file,
# and the next holder of its lock removes a half-written shard (``data/prepare.py``)
INTACT_CACHE = "the data cache is intact (finished shards are kept; the next run continues from them)"


@dataclass(frozen=True)
class Part:
    doing: str  # "preparing the data"
    safe: str | None  # what an interruption here leaves intact, for the interrupted line


_PART = "ddptrain_interrupted_part"  # set on the KeyboardInterrupt by the innermost part it left


@contextmanager
def starting(doing: str, detail: str = "", safe: str | None = None) -> Iterator[None]:
    """Log that start-up begins ``doing`` (rank 0's console shows it); a Ctrl-C inside it is marked as having
    interrupted it (the innermost part)."""
    log.info("%s%s", doing, f" ({detail})" if detail else "")
    try:
        yield
    except KeyboardInterrupt as exc:
        if not hasattr(exc, _PART):
            setattr(exc, _PART, Part(doing, safe))
        raise


def interrupted_line(exc: KeyboardInterrupt) -> str:
    """The command's one line after Ctrl-C outside the training loop (whose own stop checkpoints and says so)."""
    part = getattr(exc, _PART, None)
    if part is None:
        return "interrupted (SIGINT)"
    return f"interrupted (SIGINT) while {part.doing}" + (f"; {part.safe}" if part.safe else "")
