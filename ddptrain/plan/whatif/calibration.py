"""What the what-if predictor takes from a measured run's ``summary.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ddptrain.errors import ConfigError
from ddptrain.telemetry.summary import RunSummary


@dataclass(frozen=True)
class Calibration:
    """One rank's measured step: compute per micro-batch, optimizer, and the gradient buckets of a timed step."""

    world_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    micro_step_s: float  # data + forward + backward compute of one micro-batch on one rank
    optimizer_s: float
    buckets: list[tuple[float, int]]  # (seconds before backward compute ended that it was ready, bytes)
    buckets_measured: bool  # False: one bucket of all fp32 gradients, ready when backward ends (no overlap)
    # Per-bucket cost of the sync's own work beside the collective (DDP's hook: the division by the world size,
    # the future and its callback), timed where the collective itself is free: a 1-rank run. 0 otherwise.
    hook_s: float = 0.0
    # The mean wait for the slowest rank per second of busy time, from the run's straggler telemetry
    # (``rank_wait_for_slowest_pct``): 0 on one rank, or from a run that predates that figure.
    skew: float = 0.0
    # Real tokens per sequence, as the run measured them (``tokens_per_sequence``): below seq_len for
    # prompt/completion rows; None (seq_len) for a run that predates the figure.
    tokens_per_sequence: float | None = None

    @property
    def sequence_tokens(self) -> float:
        """Real tokens per sequence: the measured figure, else seq_len (fixed blocks)."""
        return self.tokens_per_sequence or float(self.seq_len)

    @classmethod
    def from_summary(cls, summary: RunSummary) -> Calibration:
        """From a run's figures; KeyError (naming the figure)/TypeError/ValueError when one is missing or
        malformed."""
        steady = summary.steady
        micro = (_needed(steady.time_data_s, "time_data_s") + (steady.time_forward_sync_s or 0.0)
                 + _needed(steady.time_forward_s, "time_forward_s")
                 + _needed(steady.time_backward_s, "time_backward_s")) / _needed(summary.grad_accum, "grad_accum")
        buckets = [(float(lead), int(n)) for lead, n in summary.buckets or []]
        measured = bool(buckets)
        buckets = buckets or [(0.0, 4 * int(_needed(summary.parameters, "parameters")))]
        world_size = _needed(summary.world_size, "world_size")
        comm_s = steady.comm_time_s
        alone = world_size == 1 and measured and comm_s is not None
        return cls(world_size, _needed(summary.global_batch_size, "global_batch_size"),
                   _needed(summary.micro_batch_size, "micro_batch_size"), summary.grad_accum,
                   _needed(summary.seq_len, "seq_len"), micro, _needed(steady.time_optimizer_s, "time_optimizer_s"),
                   buckets, measured, comm_s / len(buckets) if alone and comm_s is not None else 0.0,
                   float(steady.rank_wait_for_slowest_pct or 0.0) / 100, steady.tokens_per_sequence)

    @classmethod
    def from_run(cls, run_dir: str) -> Calibration:
        path = Path(run_dir) / "summary.json"
        try:
            return cls.from_summary(RunSummary.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"plan.from_run={run_dir}: expected a finished run directory with a summary.json "
                              f"holding the step breakdown ({type(exc).__name__}: {exc})") from exc


Figure = TypeVar("Figure")


def _needed(value: Figure | None, name: str) -> Figure:
    """A figure the calibration cannot do without; KeyError naming it when the summary lacks it."""
    if value is None:
        raise KeyError(name)
    return value
