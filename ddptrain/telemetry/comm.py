"""Gradient-sync figures of one step: payload bytes, time in flight, exposed time, overlap, algbw and busbw.

Bandwidths follow nccl-tests: algbw = S / t for an all-reduce of S bytes taking t; busbw = algbw · 2(N-1)/N,
the rate each link must sustain, comparable across world sizes and with the hardware's peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ddptrain.comm.clock import CommClock


@dataclass(frozen=True)
class SyncSample:
    payload_bytes: float  # S: bytes handed to the collectives (compressed when compression is on)
    # Time with at least one gradient collective in flight, and time from the end of backward compute to the
    # end of the last collective (logged as time_exposed_comm_s); None where no clock can see the collectives.
    comm_s: float | None
    exposed_s: float | None
    # per bucket, in launch order: (seconds before backward compute ended that it became ready, bytes);
    # what the what-if predictor needs to model overlap (empty when the strategy does not report it)
    buckets: tuple[tuple[float, int], ...] = ()
    # what the step would hand to the collectives with its compression in effect: differs from payload_bytes
    # only while a compression that starts late (PowerSGD before parallel.powersgd_start_iter) still sends plain
    steady_bytes: float | None = None

    @property
    def compressed_bytes(self) -> float:
        """The payload of a step with the compression in effect (payload_bytes where there is no delay)."""
        return self.payload_bytes if self.steady_bytes is None else self.steady_bytes


class SyncMeter(Protocol):
    """What measures a strategy's gradient sync, step by step: torch DDP's metered hook (``CommMeter``) or our
    engines' reducer (``EngineMeter``). The loop reads it once per step, through ``Wrapped.take_sync_sample``."""

    @property
    def clock(self) -> CommClock:
        """The clock the collectives are timed on (host on gloo, CUDA events on CUDA)."""
        ...

    def take_sample(self, world_size: int, sampled: bool) -> tuple[SyncSample | None, float | None]:
        """The last step's sync (None unless ``sampled``: CUDA events are readable only after the timer's
        synchronization) and its compression ratio (None where there is none); starts the next step's count."""
        ...


def busbw_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size if world_size > 1 else 0.0


def payload_from_link_bytes(link_bytes: float, world_size: int) -> float:
    """An all-reduce engine's per-rank link bytes 2(N-1)/N·S back to its payload S."""
    factor = busbw_factor(world_size)
    return link_bytes / factor if factor else 0.0


def sync_metrics(samples: list[SyncSample], world_size: int) -> dict[str, float]:
    """Per-step means over a window's samples, as the metrics keys the sinks log.

    Without a time (a backend whose works complete at enqueue) only the bytes are logged: no time, overlap or
    bandwidth figure is derived from a clock that did not see the collectives.
    """
    if not samples:
        return {}
    n = len(samples)
    payload = sum(s.payload_bytes for s in samples) / n
    timed = [s for s in samples if s.comm_s is not None and s.exposed_s is not None]
    if len(timed) < n:
        return {"comm_bytes": payload}
    comm = sum(s.comm_s for s in timed) / n  # type: ignore[misc]
    exposed = sum(s.exposed_s for s in timed) / n  # type: ignore[misc]
    out = {"comm_bytes": payload, "comm_time_s": comm}
    if comm > 0:
        out["overlap_pct"] = 100.0 * max(0.0, 1.0 - exposed / comm)
        out["algbw_gbps"] = payload / comm / 1e9
        out["busbw_gbps"] = out["algbw_gbps"] * busbw_factor(world_size)
    return out
