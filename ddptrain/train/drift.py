"""Replicas that drift apart: each check step compares a fingerprint of every rank's parameters within its replica
group, on the check's own all-reduce, and ``train.drift_policy`` acts on a difference.

Nondeterministic kernels, a faulty GPU, silent data corruption or a bug in a hook can leave data-parallel replicas
with different weights while every loss looks fine, and torch DDP never compares them after start-up. Here each
rank fingerprints its parameters exactly (``parallel/fingerprint.py``: two 64-bit integer sums of their bits, on
the device) and puts them in its replica group's slot of the check's all-reduce, as the words and their
complements: under MAX a slot ends as the group's largest words and the complements of its smallest, so equal
means every member agrees. That adds 4 words per group to a collective that runs anyway and no host read. Only when
a slot disagrees do the ranks gather every rank's per-parameter fingerprints (one more collective, off the hot
path) to name the ranks that differ from their group's majority and the first parameter that differs.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddptrain.config.choices import DriftPolicy
from ddptrain.errors import RunEnded
from ddptrain.parallel.fingerprint import Combined, fingerprint
from ddptrain.parallel.replicas import ReplicaGroups, local_parameters, rebroadcast, replica_groups

log = logging.getLogger("ddptrain")

WORDS = 2  # a fingerprint's words (total, positional)
UNSET = torch.iinfo(torch.int64).min  # MAX's identity: another group's slot


class DriftError(RunEnded):
    """train.drift_policy=abort met replicas that differ (decided alike on every rank)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 4)


class DriftCheck:
    """This rank's part in comparing replicas at each check step, and the policy when they differ."""

    def __init__(self, model: torch.nn.Module, policy: DriftPolicy, start: int) -> None:
        self.model = model
        self.policy = policy
        self.groups = replica_groups(model) if policy != DriftPolicy.off else ReplicaGroups((), 0, None, False)
        held = list(local_parameters(model))
        self.names = [name for name, _ in held]
        # the combined fingerprint's per-parameter weights, laid out once where the parameters live
        self.combined = Combined([t for _, t in held], held[0][1].device) if self.active else None
        self.agreed_at: int | None = None  # the last check step whose fingerprints agreed, in this process
        self.start = start

    @property
    def active(self) -> bool:
        return self.policy != DriftPolicy.off and self.groups.comparable

    def describe(self) -> str:
        """What the checks compare, for the start-up log."""
        if self.policy == DriftPolicy.off:
            return "train.drift_policy=off: replicas are not compared"
        if not self.groups.comparable:
            return f"train.drift_policy={self.policy}: {self.groups.describe()}"
        return f"train.drift_policy={self.policy}: every check compares a fingerprint of the parameters: " \
            f"{self.groups.describe()}"

    def words(self, device: torch.device) -> torch.Tensor:
        """This rank's contribution to the check's all-reduce (MAX), int64 on ``device``: per replica group its
        fingerprint and the complements (``~x``: MAX of those is the complement of the smallest), MAX's identity
        in the other groups' slots. Empty when nothing is compared. Device work only: no host read."""
        if self.combined is None:
            return torch.empty(0, dtype=torch.int64, device=device)
        replica = self.combined([tensor for _, tensor in local_parameters(self.model)]).to(device)
        slots = torch.full((len(self.groups.members), 2, WORDS), UNSET, dtype=torch.int64, device=device)
        slots[self.groups.slot, 0] = replica
        slots[self.groups.slot, 1] = ~replica
        return slots.flatten()

    def settle(self, agreed: list[int], step: int) -> None:
        """After the check's all-reduce (``agreed``: the reduced words, on the host): nothing when every group
        agrees; else name the ranks and the parameter, then abort or re-broadcast (``train.drift_policy``)."""
        if not self.active:
            return
        slots = [agreed[s * 2 * WORDS:(s + 1) * 2 * WORDS] for s in range(len(self.groups.members))]
        differing = [s for s, words in enumerate(slots) if words[:WORDS] != [~w for w in words[WORDS:]]]
        if not differing:
            self.agreed_at = step
            return
        # sync point, only now that replicas differ: every rank's fingerprint of each parameter, to name them
        rows = torch.stack([fingerprint(tensor) for _, tensor in local_parameters(self.model)])
        table = self._gather(rows)
        findings = [Finding.of(self.groups.members[s], table, self.names) for s in differing]
        where = "; ".join(f.describe() for f in findings)
        since = (f"equal at step {self.agreed_at}" if self.agreed_at is not None else
                 "the first check of this run" if self.start == 0 else f"the first check since step {self.start}")
        if self.policy == DriftPolicy.abort:
            kept = f"after step {self.agreed_at}" if self.agreed_at is not None else "by this run"
            raise DriftError(f"replicas differ at step {step} ({since}): {where} (train.drift_policy=abort); "
                             f"no checkpoint was written {kept}")
        if self.groups.slot in differing:  # this rank's group: its members broadcast, the others have nothing to do
            self._repair(findings[differing.index(self.groups.slot)])
        repaired = ", ".join(f"{len(f.differing)} parameter(s) from rank {f.source}" for f in findings)
        log.warning("replicas differ at step %d (%s): %s; re-broadcast %s (train.drift_policy=rebroadcast)",
                    step, since, where, repaired)
        self.agreed_at = step

    def _gather(self, rows: torch.Tensor) -> list[list[list[int]]]:
        """Every rank's ``[parameters, WORDS]`` fingerprints, by global rank."""
        world = dist.get_world_size()
        table = rows.new_empty((world * rows.shape[0], WORDS))  # ranks one after another (gloo wants it flat)
        dist.all_gather_single(table, rows)
        return table.view(world, *rows.shape).tolist()

    def _repair(self, finding: Finding) -> None:
        """Re-broadcast, within this rank's group, every parameter some member holds differently from the
        majority's lowest rank."""
        tensors = [tensor for p, (_, tensor) in enumerate(local_parameters(self.model)) if p in finding.differing]
        with torch.no_grad():
            rebroadcast(tensors, finding.source, self.groups)


@dataclass(frozen=True)
class Finding:
    """One replica group's verdict: who differs from its majority, and where."""

    ranks: tuple[int, ...]  # the group's global ranks
    majority: list[int]  # the ranks that hold the majority's bits (a tie: the side of the group's lowest rank)
    others: list[int]  # the ranks that differ from it
    differing: list[int]  # the parameters (by their place in the model) some rank holds differently
    first: str  # the first of those, by name

    @property
    def source(self) -> int:
        return self.majority[0]

    @classmethod
    def of(cls, ranks: tuple[int, ...], table: list[list[list[int]]], names: list[str]) -> Finding:
        """The majority of ``ranks`` by their whole fingerprints (a tie goes to the side of the lowest rank, so on
        two ranks rank 0's side is the reference), the ranks that differ, and the parameters they differ in."""
        held = {r: tuple(map(tuple, table[r])) for r in ranks}
        counts = Counter(held.values())
        best = max(counts, key=lambda fp: (counts[fp], -min(r for r in ranks if held[r] == fp)))
        majority = [r for r in ranks if held[r] == best]
        others = [r for r in ranks if held[r] != best]
        differing = [p for p in range(len(names)) if any(held[r][p] != best[p] for r in others)]
        return cls(ranks, majority, others, differing, names[differing[0]])

    def describe(self) -> str:
        verb = "differs" if len(self.others) == 1 else "differ"
        reference = f"rank {self.majority[0]}" if len(self.majority) == 1 else f"the majority ({_ranks(self.majority)})"
        return f"{_ranks(self.others)} {verb} from {reference}, first in {self.first}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
