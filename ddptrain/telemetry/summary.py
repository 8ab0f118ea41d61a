"""The run's summary as a typed value: what a finished run hands the planner (its own prediction), the launcher
(Ray's ``run_worker``) and ``summary.json``.

``RunSummary.to_json`` gives ``summary.json``'s record, key for key and in the same order as the dict it replaces;
``RunSummary.from_json`` reads one back (``plan.from_run``, ``data.format=prompt_completion``'s measured lengths).
The steady-state medians are a metrics record (``steady_medians``): ``SteadyFigures`` names the figures the
planner reads and keeps the rest, in the window's order, for the JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class SteadyFigures:
    """The logged windows' medians after the first (``telemetry.metrics.steady_medians``), in the window's order;
    the planner reads them through the properties below (None when the run did not measure the figure)."""

    medians: dict[str, float] = field(default_factory=dict)

    def _figure(self, name: str) -> float | None:
        return self.medians.get(name)

    @property
    def time_step_s(self) -> float | None:
        return self._figure("time_step_s")

    @property
    def time_data_s(self) -> float | None:
        return self._figure("time_data_s")

    @property
    def time_forward_sync_s(self) -> float | None:
        return self._figure("time_forward_sync_s")

    @property
    def time_forward_s(self) -> float | None:
        return self._figure("time_forward_s")

    @property
    def time_backward_s(self) -> float | None:
        return self._figure("time_backward_s")

    @property
    def time_optimizer_s(self) -> float | None:
        return self._figure("time_optimizer_s")

    @property
    def time_exposed_comm_s(self) -> float | None:
        return self._figure("time_exposed_comm_s")

    @property
    def comm_time_s(self) -> float | None:
        return self._figure("comm_time_s")

    @property
    def rank_wait_for_slowest_pct(self) -> float | None:
        return self._figure("rank_wait_for_slowest_pct")

    @property
    def tokens_per_sequence(self) -> float | None:
        return self._figure("tokens_per_sequence")

    @property
    def attended_tokens(self) -> float | None:
        return self._figure("attended_tokens")


@dataclass
class RunSummary:
    """End-of-run figures: what ran (config essentials), the losses, the steady-state medians, the run's own
    predictions beside what it measured, and (rank 0) its goodput.

    ``predicted`` starts with the communication the analytic plan expects and gains the what-if predictor's step
    (``plan.whatif.own_run``); ``memory_peak`` (rank 0) is the planned peak beside the measured one.
    """

    world_size: int
    model: str
    parameters: int
    trainable_parameters: int
    engine: str
    zero_stage: int
    compression: str
    wrapper: str
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    steps: int
    first_step_loss: float | None  # step 1's loss, the ranks' mean (None when the run resumed after step 1)
    first_logged_step: int | None  # the first logged window's step (train.log_every, or the resumed run's first)
    first_logged_loss: float | None  # that step's loss: the first loss metrics.jsonl and the console show
    final_loss: float | None
    final_val_loss: float | None
    tokens_seen: int | None  # since step 1, a resumed run's included
    steady: SteadyFigures
    flops_per_token: float
    peak_tflops: float | None
    predicted: dict[str, Any]
    model_state: dict[str, Any]
    buckets: list[list[float]]  # the last timed step's gradient buckets: [seconds before backward ended, bytes]
    compile_s: float | None = None  # train.compile: the first step's compile time
    loss_scale: dict[str, float] = field(default_factory=dict)  # fp16: the final scale and back-offs
    memory_peak: dict[str, Any] | None = None  # rank 0
    goodput: dict[str, Any] = field(default_factory=dict)  # rank 0: goodput_pct and its breakdown

    def to_json(self) -> dict[str, Any]:
        """``summary.json``'s record. Built in the order the record has always had: the fixed figures with the
        medians after ``tokens_seen``; then the compile time, fp16's scale (which replaces the medians' figures of
        the same names in place), the memory peak and goodput."""
        record: dict[str, Any] = {}
        for f in fields(self):
            if f.name in _APPENDED:
                continue
            if f.name == "steady":
                record.update(self.steady.medians)
            else:
                record[f.name] = getattr(self, f.name)
        if self.compile_s is not None:
            record["compile_s"] = self.compile_s
        record.update(self.loss_scale)
        if self.memory_peak is not None:
            record["memory_peak"] = self.memory_peak
        record.update(self.goodput)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RunSummary:
        """A ``summary.json`` record read back. A figure it lacks (an earlier version's summary, a hand-written
        one) is None; every key that is no field is a steady-state median. TypeError when it is no record."""
        if not isinstance(record, dict):
            raise TypeError(f"a run summary is a JSON object, not {type(record).__name__}")
        names = {f.name for f in fields(cls)} - {"steady", *_APPENDED}
        known = {name: record.get(name) for name in names}
        if "first_logged_loss" not in record:  # an earlier version's name for the first logged window's loss
            known["first_logged_loss"] = record.get(_FIRST_LOSS)
        return cls(**known, steady=SteadyFigures({k: v for k, v in record.items() if k not in names and k not in
                                                  _NOT_MEDIANS}),
                   compile_s=record.get("compile_s"),
                   loss_scale={k: record[k] for k in LOSS_SCALE_KEYS if k in record},
                   memory_peak=record.get("memory_peak"),
                   goodput={k: record[k] for k in GOODPUT_KEYS if k in record})


_APPENDED = ("compile_s", "loss_scale", "memory_peak", "goodput")
LOSS_SCALE_KEYS = ("loss_scale", "scaler_backoffs")  # train/loss_scale.py's window()
GOODPUT_KEYS = ("goodput_pct", "goodput")  # telemetry/goodput.py's report()
_FIRST_LOSS = "first_loss"  # before the losses were named for their steps: the first logged window's loss
_NOT_MEDIANS = {"compile_s", "memory_peak", _FIRST_LOSS, *GOODPUT_KEYS}
