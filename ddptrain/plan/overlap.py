"""One gradient sync on a timeline: buckets all-reduce one at a time, each from when backward makes it ready.

Time 0 is when the first bucket becomes ready; backward's remaining compute then runs to its end while the
buckets' all-reduces queue behind each other. A collective starts when every rank has its bucket ready: a rank
whose peer is ``wait`` seconds behind sees each all-reduce start ``wait`` after its own bucket is ready (or
later, behind the previous one), so a wait overlaps whatever the queue still has in flight instead of adding
to it. Where ranks share cores with their collectives (gloo on CPU), a collective takes ``busy_seconds``
instead of ``seconds`` while compute runs, and takes ``steal_s_per_byte`` seconds of compute per byte it
reduces beside compute (its reduction and copies on the cores: a latency-bound small all-reduce takes little,
however long it is in flight); with NCCL on its own stream and a GPU per rank neither changes anything.

The busy time is a lone collective's: its latency includes waking the collective's thread on a core busy with
compute. A collective queued while the previous one is still in flight finds that thread awake, so it takes
``queued_seconds`` instead (on CPU: the idle link's latency with the busy link's bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncTimeline:
    exposed_s: float  # how far the last all-reduce runs past the end of backward's compute
    comm_s: float  # time with an all-reduce in flight
    stolen_s: float  # how much longer backward's compute took because collectives ran beside it


def sync_timeline(buckets: list[tuple[float, int]], seconds: Callable[[float], float], steal_s_per_byte: float = 0.0,
                  busy_seconds: Callable[[float], float] | None = None,
                  queued_seconds: Callable[[float], float] | None = None, wait: float = 0.0) -> SyncTimeline:
    """Simulate the sync of ``buckets`` ((seconds before backward's compute ended that it was ready, bytes), in
    launch order), each all-reduce taking ``seconds(bytes)`` on an idle host, ``busy_seconds(bytes)`` beside
    compute when it starts on an idle queue and ``queued_seconds(bytes)`` beside compute when it was ready
    before the previous one finished (defaults: the idle time, then the busy time), starting no earlier than
    ``wait`` after this rank's bucket is ready (the peer's lag)."""
    if not buckets:
        return SyncTimeline(0.0, 0.0, 0.0)
    length = max(lead for lead, _ in buckets)  # backward compute left when the first bucket is ready
    ready = [length - lead for lead, _ in buckets]  # in compute-seconds done since then
    left_total = [seconds(n) for _, n in buckets]
    left = list(left_total)  # idle-host seconds of all-reduce still to do, per bucket
    lone = left_total if busy_seconds is None else [busy_seconds(n) for _, n in buckets]
    queued = lone if queued_seconds is None else [queued_seconds(n) for _, n in buckets]
    busy = list(lone)  # beside compute, per bucket: lone until it is known to have queued
    reached: list[float] = []  # when this rank's compute made each bucket ready, in order
    now = done = comm = 0.0
    compute_end = 0.0 if length <= 0 else None
    i = 0
    while i < len(buckets):
        while len(reached) < len(buckets) and done >= ready[len(reached)]:
            reached.append(now)
        computing = compute_end is None
        gate = reached[i] + wait if i < len(reached) else float("inf")  # every rank's bucket i is ready
        active = now >= gate
        comm_rate = (left_total[i] / busy[i] if busy[i] > 0 else 1.0) if computing else 1.0
        # the compute this collective takes, spread over its time beside compute (at most all of it)
        stolen = min(1.0, steal_s_per_byte * buckets[i][1] / busy[i]) if busy[i] > 0 else 0.0
        compute_rate = (1.0 - stolen) if active else 1.0
        target = ready[len(reached)] if len(reached) < len(buckets) else length  # the next readiness or the end
        to_target = (target - done) / compute_rate if computing and compute_rate > 0 else float("inf")
        to_gate = gate - now if not active else float("inf")
        to_finish = left[i] / comm_rate if active else float("inf")
        dt = min(to_target, to_gate, to_finish)
        now += dt
        if active:
            comm += dt
            left[i] -= dt * comm_rate
        if computing:
            done = target if to_target <= dt else done + dt * compute_rate
            if done >= length:
                compute_end = now
        if active and to_finish <= dt:
            i += 1
            if i < len(buckets) and done >= ready[i]:  # ready while bucket i-1 was in flight: its thread is awake
                busy[i] = queued[i]
    if compute_end is None:  # every all-reduce finished before backward did
        compute_end = now + (length - done)
    return SyncTimeline(max(0.0, now - compute_end), comm, compute_end - length)
