"""Steps 2 and 3: all-reduce each gradient from a post-accumulate-grad hook, as soon as it is ready."""

from __future__ import annotations

from ddptrain.engines.base import DataParallelEngine
from ddptrain.engines.reducer import Policy


class OverlapSyncDDP(DataParallelEngine):
    """Launch each gradient's all-reduce when it is ready and wait at once: backward stalls on every collective."""

    policy = Policy(bucketed=False, overlap=True, blocking=True)


class OverlapAsyncDDP(DataParallelEngine):
    """Launch each gradient's all-reduce when it is ready, non-blocking; wait for all of them after backward."""

    policy = Policy(bucketed=False, overlap=True, blocking=False)
