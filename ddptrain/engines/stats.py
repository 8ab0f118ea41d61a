"""What gradient synchronisation cost in the last synchronised backward (CPU clock only, no device sync)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    """Filled during one synchronised backward; a fresh instance starts with each, so a kept one stays valid."""

    bytes_sent: int = 0  # bytes this rank sent for gradient sync, 2(N-1)/N · D per all-reduce of D bytes
    collective_s: float = 0.0  # wall time the training thread spent launching and waiting on collectives
    exposed_s: float = 0.0  # wall time from the end of backward compute until every gradient is averaged
