"""Bytes on the wire and time in flight: what one rank's collectives cost, by the algorithm's own accounting."""

from __future__ import annotations


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends to all-reduce ``nbytes``: 2(N-1)/N · D, the ring's volume and the lower bound.

    It is also nccl-tests' bus-bandwidth numerator: busbw = all_reduce_bytes(D, N) / time.
    """
    return 2 * (world_size - 1) * nbytes // world_size


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) intervals merged into a sorted list of disjoint ones."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def in_flight_seconds(spans: list[tuple[float, float]]) -> float:
    """Wall time during which at least one of the (start, end) spans was open."""
    return sum(end - start for start, end in union(spans))
