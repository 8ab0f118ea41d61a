"""Counting the chunked loss's work (``train.chunked_loss``): proof that a run took the chunked path, and how."""

from __future__ import annotations

from typing import Any

from ddptrain.models.chunked_loss import LinearCrossEntropy
from tests.helpers.runs import Overrides, train_outcomes


class CountedChunks:
    """Counts ``LinearCrossEntropy``'s forward calls and the chunks they ran while the context is open."""

    def __init__(self) -> None:
        self.calls = 0
        self.chunks = 0

    def __enter__(self) -> CountedChunks:
        self.original = LinearCrossEntropy.forward

        def counted(ctx, hidden, weight, targets, chunk, compute_dtype):  # type: ignore[no-untyped-def]
            self.calls += 1
            self.chunks += -(-hidden.shape[0] // chunk)
            return self.original(ctx, hidden, weight, targets, chunk, compute_dtype)

        LinearCrossEntropy.forward = staticmethod(counted)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        LinearCrossEntropy.forward = staticmethod(self.original)  # type: ignore[method-assign]


def outcomes_counting_chunks(rank: int, world_size: int, tmp: str, base: Overrides,
                             variants: list[tuple[str, Overrides, str | None]]) -> list[dict[str, Any]]:
    """For ``run_distributed``: ``train_outcomes`` (no traced plan) one variant at a time, each outcome with the
    chunked loss's forward ``calls`` and ``chunks`` on this rank."""
    out = []
    for variant in variants:
        with CountedChunks() as counted:
            (outcome,) = train_outcomes(rank, world_size, tmp, base, [variant], False)
        out.append({**outcome, "calls": counted.calls, "chunks": counted.chunks})
    return out
