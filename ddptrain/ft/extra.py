"""The ``ft`` extra: torchft is imported only by a run with replica groups, and its absence is one line."""

from __future__ import annotations

import importlib.util

from ddptrain.errors import ConfigError

INSTALL = "pip install 'ddptrain[ft]'"


def require_torchft(replica_groups: int) -> None:
    """Refuse a run with replica groups (exit 2, before any worker starts) when torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"ft.replica_groups={replica_groups} needs torchft, which is not installed: {INSTALL}")
