"""The run's own measured memory peak per rank, beside which the memory planner's plan for the run is reported
(``plan/memory/own_peak.py``): on CUDA, ``torch.cuda.max_memory_allocated`` over the steady steps (reset after the
first step); on CPU, which has no allocator statistics, ``PeakTracker`` (``telemetry/storage_peak.py``) around one
steady step of the run (the second), on the run's real tensors, with the model state marked at its start."""

from __future__ import annotations

from typing import Any

import torch

from ddptrain.telemetry.storage_peak import PeakTracker, model_state_tensors, step_tracker


class MeasuredPeak:
    """The run's measured peak per rank: ``begin``/``end`` bracket every training step (the update included)."""

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 first_step: int, zero_stage: int) -> None:
        self.device, self.model, self.optimizer = device, model, optimizer
        self.first_step = first_step  # the run's first step here (after a resume: the step after the checkpoint)
        self.tracker: PeakTracker | None = None
        self.bytes: int | None = None
        self.note = ("torch.cuda.max_memory_allocated over the steady steps" if device.type == "cuda" else
                     "PeakTracker over one steady step (the run's second)")
        self.skip = zero_stage >= 2 and device.type != "cuda"  # FSDP2's DTensor shards: not tracked on CPU
        if self.skip:
            self.note = "not measured on CPU at ZeRO-2/3 (sharded parameters)"

    def begin(self, step: int) -> None:
        if self.skip or step != self.first_step + 1:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.tracker = step_tracker(self.model, "cpu")
        self.tracker.__enter__()
        params, state = model_state_tensors(self.model, self.optimizer)
        self.tracker.mark(params, "parameters")
        self.tracker.mark(state, "optimizer")
        self.tracker.mark((p.grad for p in self.model.parameters()), "gradients")

    def slows(self, step: int) -> bool:
        """Whether ``step`` ran under the CPU tracker (slower than a plain step: kept out of throughput)."""
        return not self.skip and self.device.type != "cuda" and step == self.first_step + 1

    def end(self, step: int) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.bytes = self.tracker.peak.peak
            self.tracker = None

    def result(self, step: int) -> int | None:
        """The peak, once the run has finished ``step`` (None: no steady step ran)."""
        if self.device.type == "cuda" and not self.skip and step > self.first_step:
            return torch.cuda.max_memory_allocated(self.device)  # sync point: once, at the end
        return self.bytes


def memory_peak(planned: tuple[float | None, str], measured: MeasuredPeak, last_step: int) -> dict[str, Any]:
    """summary.json's ``memory_peak``: planned vs measured bytes per rank, and how each was found."""
    planned_bytes, how = planned
    measured_bytes = measured.result(last_step)
    error = None
    if planned_bytes and measured_bytes:
        error = 100.0 * (planned_bytes - measured_bytes) / measured_bytes
    return {"planned_bytes": None if planned_bytes is None else round(planned_bytes),
            "measured_bytes": measured_bytes, "error_pct": error, "planned_by": how, "measured_by": measured.note}
