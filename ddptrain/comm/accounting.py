"""Bytes on the wire: what one rank sends for a collective, by the algorithm's own accounting."""

from __future__ import annotations


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends to all-reduce ``nbytes``: 2(N-1)/N · D, the ring's volume and the lower bound.

    It is also nccl-tests' bus-bandwidth numerator: busbw = all_reduce_bytes(D, N) / time.
    """
    return 2 * (world_size - 1) * nbytes // world_size
