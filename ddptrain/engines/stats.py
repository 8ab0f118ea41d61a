"""What gradient synchronisation cost in the last synchronised backward (CPU clock only, no device sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddptrain.comm.accounting import in_flight_seconds


@dataclass
class CommStats:
    """Filled during one synchronised backward; a fresh instance starts with each, so a kept one stays valid."""

    bytes_sent: int = 0  # bytes this rank sent for gradient sync, 2(N-1)/N · D per all-reduce of D bytes
    collective_s: float = 0.0  # wall time the training thread spent launching and waiting on collectives
    exposed_s: float = 0.0  # wall time from the end of backward compute until every gradient is averaged
    # (launch, completion) of each collective on the host clock; completion is seen by a callback on the
    # collective's own thread (gloo, ring), or at the join when the handle cannot report it.
    spans: list[tuple[float, float]] = field(default_factory=list)

    @property
    def in_flight_s(self) -> float:
        """Wall time with at least one gradient collective in flight: the communication overlap is judged on."""
        return in_flight_seconds(self.spans)
