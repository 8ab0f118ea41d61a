"""What a finished run (``plan.from_run``) measured about its data, read back from its ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path

from ddptrain.telemetry.summary import RunSummary


def measured_lengths(run_dir: str | None) -> tuple[float, float] | None:
    """A finished run's real tokens per sequence and attended tokens (Σ T² / Σ T) from its ``summary.json``; None
    without a run or the figures (a run that predates them)."""
    if not run_dir:
        return None
    try:
        steady = RunSummary.from_json(json.loads((Path(run_dir) / "summary.json").read_text())).steady
    except (OSError, ValueError, TypeError):
        return None
    if steady.tokens_per_sequence is None or steady.attended_tokens is None:
        return None
    try:
        return float(steady.tokens_per_sequence), float(steady.attended_tokens)
    except (ValueError, TypeError):
        return None
