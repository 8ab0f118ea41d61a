"""Goodput under failures, as a model: restart-the-world (torchrun's elastic agent) against replica groups that fail
and heal alone (torchft, ``ft.replica_groups``).

Failures arrive at random (Poisson) at ``failures_per_hour`` for the whole job, each taking down one GPU's process
and so, with replica groups, one group. Both policies then pay, per failure, in GPU-seconds:

- **restart-the-world**: every GPU waits for the restart (``restart_s``: detection, teardown, rendezvous, model
  build, reload) and every GPU's work since the last checkpoint is redone (half the checkpoint period on average,
  failures being uniform within it);
- **replica groups**: every GPU loses the step in flight and the time the survivors take to notice (``detect_s``:
  the collective's error or the lighthouse's heartbeat timeout, then a new quorum); only the failed group's GPUs
  (1/R of them) wait for its restart and its live recovery from a peer (``group_restart_s + heal_s``). The
  survivors keep stepping, on a smaller global batch, and those steps count as productive.

Each policy also pays in steady state: a blocking checkpoint save every ``checkpoint_every_s`` of training, and,
for replica groups, the per-step cost of the quorum and the commit vote (``step_overhead``, a fraction of a step).

The result is first order in the failure rate: exact when failures are rare next to the time each one costs
(``failures_per_hour`` x cost per failure well below an hour) and, past that, a lower bound clipped at 0 (failures
during a restart are not counted twice). The inputs are measured: ``scripts/bench_ft.py`` measures them on this
machine's CPU runs, and docs/benchmarks.md carries them to scale, saying which are assumed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FailureCosts:
    """What one failure and the steady state cost, in seconds; see the module's docstring."""

    step_s: float  # one training step
    checkpoint_every_s: float  # training seconds between checkpoints
    save_s: float  # one blocking checkpoint save
    restart_s: float  # restart-the-world: failure to the first step again, every rank
    detect_s: float  # replica groups: failure to the survivors' next committed step
    group_restart_s: float  # replica groups: the failed group's restart by its own agent
    heal_s: float  # replica groups: the failed group's recovery from a peer
    step_overhead: float = 0.0  # replica groups: the quorum and commit vote, as a fraction of a step

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"{name}={value}: expected seconds (or a fraction) >= 0")
        if self.step_s <= 0 or self.checkpoint_every_s <= 0:
            raise ValueError("step_s and checkpoint_every_s must be positive")


@dataclass(frozen=True)
class PolicyGoodput:
    """A policy's goodput (productive GPU-time over all GPU-time) and where the rest went, as fractions."""

    goodput: float
    lost: dict[str, float]  # each cost's share of the GPU-time


def _clipped(lost: dict[str, float]) -> PolicyGoodput:
    return PolicyGoodput(max(0.0, 1.0 - sum(lost.values())), lost)


def restart_the_world(costs: FailureCosts, failures_per_hour: float) -> PolicyGoodput:
    """Goodput when any failure restarts every rank from the last checkpoint."""
    rate = failures_per_hour / 3600.0
    return _clipped({"checkpoint saves": costs.save_s / (costs.checkpoint_every_s + costs.save_s),
                     "restarts": rate * costs.restart_s,
                     "redone work": rate * costs.checkpoint_every_s / 2})


def replica_groups(costs: FailureCosts, failures_per_hour: float, groups: int) -> PolicyGoodput:
    """Goodput when a failure takes out one of ``groups`` replica groups, which restarts and heals alone."""
    if groups < 2:
        raise ValueError(f"groups={groups}: replica groups need at least 2 (one survives)")
    rate = failures_per_hour / 3600.0
    return _clipped({"checkpoint saves": costs.save_s / (costs.checkpoint_every_s + costs.save_s),
                     "quorum per step": costs.step_overhead / (1.0 + costs.step_overhead),
                     "detection": rate * (costs.detect_s + costs.step_s),
                     "group restarts": rate * (costs.group_restart_s + costs.heal_s) / groups})
