"""Timers, metrics and where they go (console, metrics.jsonl, W&B)."""

from ddptrain.telemetry.logs import setup_logging
from ddptrain.telemetry.sinks import Sinks

__all__ = ["Sinks", "setup_logging"]
