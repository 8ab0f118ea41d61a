"""Step 1: after backward, one blocking all-reduce per gradient. Correct, simple, and nothing overlaps."""

from __future__ import annotations

from ddptrain.engines.base import DataParallelEngine
from ddptrain.engines.reducer import Policy


class NaiveDDP(DataParallelEngine):
    """All-reduce every gradient once backward has finished (ignores the bucket arguments)."""

    policy = Policy(bucketed=False, overlap=False, blocking=True)
