"""Step 4: gradients in contiguous bucket buffers, one non-blocking all-reduce per full bucket."""

from __future__ import annotations

from ddptrain.engines.base import DataParallelEngine
from ddptrain.engines.reducer import Policy


class BucketedDDP(DataParallelEngine):
    """Few large collectives instead of many small ones: per-call latency is paid once per bucket.

    With ``gradient_as_bucket_view=True`` each ``.grad`` is a view into its bucket, so no copy is made.
    """

    policy = Policy(bucketed=True, overlap=True, blocking=False)
