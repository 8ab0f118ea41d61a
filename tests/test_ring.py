"""The ring all-reduce equals gloo's own all-reduce, for awkward lengths and world sizes, at 2(N-1)/N · D bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddptrain.comm import all_reduce_bytes, all_reduce_sum, ring_all_reduce
from tests.helpers.dist import run_distributed

SIZES = (1, 7, 1000, 10**6)


def _ring_vs_native(rank: int, world_size: int) -> list[str]:
    """Every size and op, plus a non-contiguous tensor and the async launcher; returns the failures seen."""
    failures = []
    for size in SIZES:
        for op in ("sum", "avg"):
            x = torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + size))
            expected = x.clone()
            dist.all_reduce(expected)
            if op == "avg":
                expected /= world_size
            sent = ring_all_reduce(x, op)
            if not torch.allclose(x, expected, rtol=1e-5, atol=1e-6):
                failures.append(f"size={size} op={op}: max error {(x - expected).abs().max():.3g}")
            if size % world_size == 0 and sent != all_reduce_bytes(size * 4, world_size):
                failures.append(f"size={size}: sent {sent} bytes, expected {all_reduce_bytes(size * 4, world_size)}")
            if abs(sent - all_reduce_bytes(size * 4, world_size)) > 2 * 4:
                failures.append(f"size={size}: sent {sent} bytes, far from 2(N-1)/N·D")
    strided = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)
    ring_all_reduce(strided)
    if not torch.equal(strided, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world_size + 1))):
        failures.append("non-contiguous tensor reduced wrongly")
    y = torch.full((33,), float(rank))
    all_reduce_sum(y, "ring", None).wait()
    if not torch.equal(y, torch.full((33,), float(sum(range(world_size))))):
        failures.append("async ring launch reduced wrongly")
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_equals_native(world_size: int) -> None:
    for rank, failures in enumerate(run_distributed(_ring_vs_native, world_size)):
        assert not failures, f"rank {rank}: {failures}"


def test_all_reduce_bytes_is_two_n_minus_one_over_n() -> None:
    assert all_reduce_bytes(1200, 1) == 0
    assert all_reduce_bytes(1200, 2) == 1200
    assert all_reduce_bytes(1200, 4) == 1800


def test_unknown_op_is_refused() -> None:
    with pytest.raises(ValueError, match="op='max'"):
        ring_all_reduce(torch.ones(2), "max")
