"""The clock that gradient collectives are timed on: the host's, CUDA events, or none where neither sees them.

A gloo work completes on gloo's own threads once its data has moved, so host timestamps taken when it is
launched and when its future completes span the real collective. An NCCL work's future completes as soon as the
work is enqueued on its stream, and ``work.wait()`` does not block the host, so host timestamps would measure the
launch: there the span is timed by CUDA events recorded on the stream that runs the collective (before launch,
after completion) and read only after the step's device synchronization. Any other backend whose works complete
at enqueue (torch's fake process group, for one) gets no clock: its figures are reported as unavailable, never
as a wrong number.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

# A point in time on one clock: perf_counter seconds (host), a recorded torch.cuda.Event (cuda), None (none).
Mark = Any
Span = tuple[Mark, Mark]


class ClockKind(StrEnum):
    host = "host"
    cuda = "cuda"
    none = "none"


class CommClock:
    """Marks points in time on the clock that can see a collective, and turns spans of marks into seconds."""

    def __init__(self, kind: ClockKind, backend: str = "") -> None:
        self.kind = kind
        self.backend = backend  # for the message when timing is unavailable

    @classmethod
    def for_collectives(cls, device: torch.device, group: dist.ProcessGroup | None = None) -> CommClock:
        """CUDA events for CUDA tensors; the host clock where gloo runs CPU tensors; otherwise no clock."""
        backend = str(dist.get_backend(group))
        if device.type == "cuda":
            return cls(ClockKind.cuda, backend)
        # A device-mapped backend ("cuda:nccl,cpu:gloo") runs CPU tensors on gloo too.
        return cls(ClockKind.host if "gloo" in backend else ClockKind.none, backend)

    @property
    def available(self) -> bool:
        return self.kind != ClockKind.none

    def mark(self) -> Mark:
        """Now: the host clock, or an event recorded on the current CUDA stream (runs after what is queued there)."""
        if self.kind == ClockKind.host:
            return time.perf_counter()
        if self.kind == ClockKind.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return None

    def resolve(self, spans: list[Span]) -> list[tuple[float, float]] | None:
        """The spans in seconds on one common origin; None when this clock cannot see collectives.

        CUDA events must have completed (read after the step's device synchronization).
        """
        if self.kind == ClockKind.none:
            return None
        if self.kind == ClockKind.host or not spans:
            return list(spans)
        origin = spans[0][0]
        return [(origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3) for start, end in spans]

    def unavailable_reason(self) -> str:
        return (f"gradient-sync timing is unavailable on backend {self.backend!r}: its works complete when they are "
                "enqueued, so host timestamps would measure the launch, not the collective; comm_time_s, "
                "overlap_pct, algbw_gbps, busbw_gbps and time_exposed_comm_s are not logged")
