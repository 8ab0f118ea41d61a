"""Counting the replica drift check's work (``train.drift_policy``): proof that a run compared its replicas."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.chunks import outcomes_counting_chunks
from tests.helpers.runs import Overrides


class CountedDriftChecks:
    """Counts the checks at which ``DriftCheck`` compared this rank's replicas (``compared``) and those that found
    them different (``differed``: it gathers every rank's fingerprints only then) while the context is open."""

    def __init__(self) -> None:
        self.compared = 0
        self.differed = 0

    def __enter__(self) -> CountedDriftChecks:
        from ddptrain.train.drift import DriftCheck

        self.owner, self.settle, self.gather = DriftCheck, DriftCheck.settle, DriftCheck._gather

        def settle(check: DriftCheck, agreed: list[int], step: int) -> None:
            self.compared += check.active
            self.settle(check, agreed, step)

        def gather(check: DriftCheck, rows: torch.Tensor) -> list[list[list[int]]]:
            self.differed += 1
            return self.gather(check, rows)

        self.owner.settle, self.owner._gather = settle, gather  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.owner.settle, self.owner._gather = self.settle, self.gather  # type: ignore[method-assign]


def outcomes_counting_checks(rank: int, world_size: int, tmp: str, base: Overrides,
                             variants: list[tuple[str, Overrides, str | None]]) -> list[dict[str, Any]]:
    """For ``run_distributed``: ``outcomes_counting_chunks`` one variant at a time, each outcome also with the
    replica checks it ``compared`` and found ``differed`` on this rank."""
    out = []
    for variant in variants:
        with CountedDriftChecks() as drift:
            (outcome,) = outcomes_counting_chunks(rank, world_size, tmp, base, [variant])
        out.append({**outcome, "compared": drift.compared, "differed": drift.differed})
    return out
