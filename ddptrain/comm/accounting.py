"""Bytes on the wire and time in flight: what one rank's collectives cost, by the algorithm's own accounting."""

from __future__ import annotations


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends to all-reduce ``nbytes``: 2(N-1)/N · D, the ring's volume and the lower bound.

    It is also nccl-tests' bus-bandwidth numerator: busbw = all_reduce_bytes(D, N) / time.
    """
    return 2 * (world_size - 1) * nbytes // world_size


def in_flight_seconds(spans: list[tuple[float, float]]) -> float:
    """Wall time during which at least one of the (start, end) spans was open: the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
