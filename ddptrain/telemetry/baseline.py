"""``metrics.baseline``: the single-rank tokens/s that scaling efficiency divides by.

Checked at start-up by the launcher too, so this module imports no torch and no data library.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddptrain.errors import ConfigError


def load_baseline(value: str | None) -> float | None:
    """Single-rank tokens/s: a number, or a run directory whose summary.json holds ``tokens_per_s_per_rank``."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    summary = Path(value) / "summary.json"
    try:
        tps = json.loads(summary.read_text())["tokens_per_s_per_rank"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"metrics.baseline={value}: expected tokens/s or a run directory with a summary.json ({exc})"
        ) from exc
    if not tps or tps <= 0:
        raise ConfigError(f"metrics.baseline={value}: {summary} holds no positive tokens_per_s_per_rank")
    return float(tps)
