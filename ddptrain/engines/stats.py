"""What gradient synchronisation cost in the last synchronised backward, on the clock that can see it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddptrain.comm.accounting import in_flight_seconds
from ddptrain.comm.clock import ClockKind, CommClock, Span


@dataclass
class CommStats:
    """Filled during one synchronised backward; a fresh instance starts with each, so a kept one stays valid.

    Times come from ``clock`` (the host on gloo, CUDA events on CUDA) and are None where no clock can see the
    collectives. CUDA events are read only once the device has caught up (after the step's synchronization).
    """

    clock: CommClock = field(default_factory=lambda: CommClock(ClockKind.host))
    bytes_sent: int = 0  # bytes this rank sent for gradient sync, 2(N-1)/N · D per all-reduce of D bytes
    collective_s: float = 0.0  # host time the training thread spent launching and waiting on collectives
    # (launch, completion) of each collective; completion is marked by a callback where the collective ends
    # (gloo's or the ring's thread, the stream NCCL's callback runs on), or at the join when none can report it.
    spans: list[Span] = field(default_factory=list)
    # (end of backward compute, every gradient averaged): the stretch backward waited for communication.
    exposed: Span | None = None

    @property
    def in_flight_s(self) -> float | None:
        """Time with at least one gradient collective in flight: the communication overlap is judged on."""
        spans = self.clock.resolve(self.spans)
        return None if spans is None else in_flight_seconds(spans)

    @property
    def exposed_s(self) -> float | None:
        """Time from the end of backward compute until every gradient is averaged."""
        if self.exposed is None:
            return 0.0 if self.clock.available else None
        span = self.clock.resolve([self.exposed])
        return None if span is None else span[0][1] - span[0][0]
