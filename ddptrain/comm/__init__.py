"""From-scratch collectives and the accounting of the bytes they put on the wire."""

from ddptrain.comm.accounting import all_reduce_bytes, in_flight_seconds
from ddptrain.comm.broadcast import broadcast_coalesced
from ddptrain.comm.collectives import COLLECTIVES, Handle, all_reduce_sum, validate_collective, when_done
from ddptrain.comm.ring import ring_all_reduce

__all__ = [
    "COLLECTIVES",
    "Handle",
    "all_reduce_bytes",
    "all_reduce_sum",
    "broadcast_coalesced",
    "in_flight_seconds",
    "ring_all_reduce",
    "validate_collective",
    "when_done",
]
