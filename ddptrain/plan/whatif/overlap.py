"""One gradient sync on a timeline: buckets all-reduce one at a time, each from when backward makes it ready.

Time 0 is when the first bucket becomes ready; backward's remaining compute then runs to its end while the
buckets' all-reduces queue behind each other. A collective starts when every rank has its bucket ready: a rank
whose peer is ``wait`` seconds behind sees each all-reduce start ``wait`` after its own bucket is ready (or
later, behind the previous one), so a wait overlaps whatever the queue still has in flight instead of adding
to it. The collectives run beside compute without slowing it, as NCCL does on its own stream with a device per
rank; ranks that share CPU cores with their collectives need more (``HostTerms`` in the predictor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncTimeline:
    exposed_s: float  # how far the last all-reduce runs past the end of backward's compute
    comm_s: float  # time with an all-reduce in flight
    stolen_s: float  # how much longer backward's compute took because collectives ran beside it (0 here)


def sync_timeline(buckets: list[tuple[float, int]], seconds: Callable[[float], float],
                  wait: float = 0.0) -> SyncTimeline:
    """Simulate the sync of ``buckets`` ((seconds before backward's compute ended that it was ready, bytes), in
    launch order), each all-reduce taking ``seconds(bytes)`` and starting no earlier than ``wait`` after this
    rank's bucket is ready (the peer's lag) nor before the previous one has finished."""
    if not buckets:
        return SyncTimeline(0.0, 0.0, 0.0)
    length = max(lead for lead, _ in buckets)  # backward compute left when the first bucket is ready
    ready = free = comm = 0.0  # ready: this bucket's readiness (launch order); free: the previous one's end
    for lead, nbytes in buckets:
        ready = max(ready, length - lead)
        took = seconds(nbytes)
        free = max(ready + wait, free) + took
        comm += took
    return SyncTimeline(max(0.0, free - length), comm, 0.0)
