"""What a finished run (``plan.from_run``) measured about its data, read back from its ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path


def measured_lengths(run_dir: str | None) -> tuple[float, float] | None:
    """A finished run's real tokens per sequence and attended tokens (Σ T² / Σ T) from its ``summary.json``; None
    without a run or the figures (a run that predates them)."""
    if not run_dir:
        return None
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        return float(summary["tokens_per_sequence"]), float(summary["attended_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
