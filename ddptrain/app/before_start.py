"""The run directory's checks, made by the launcher before any worker starts and before anything is written.

A refusal here is one line and exit 2 within seconds, and leaves the run directory as it was (no ``config.yaml``,
``train.log``, ``hang/`` or empty ``checkpoints/``): the workers, which would otherwise find the same thing after
importing torch, meeting and preparing the data, are never started. Torch is imported only when the run
directory holds checkpoints or ``train.resume`` names one (``tests/test_startup.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError


def check_before_start(cfg: Config, run_dir: Path) -> Path | None:
    """Refuse (ConfigError) a run directory that cannot be written, or whose checkpoints refuse this run, as far
    as the files tell without torch; returns the checkpoint to resume, which ``check_resumable`` reads further."""
    run_dir = run_dir.absolute()
    check_writable(run_dir)
    if cfg.train.resume is not None or (run_dir / cfg.checkpoint.dir).is_dir():
        from ddptrain.checkpoint.before_start import check_checkpoints

        return check_checkpoints(cfg, run_dir)
    return None


def check_writable(run_dir: Path) -> None:
    """The run directory, or the nearest of its parents that exists, is a directory this process may write in
    (nothing is created: the workers create it once the run is known to start)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = "Not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = "Permission denied"
    if problem is not None:
        raise ConfigError(f"hydra.run.dir={run_dir}: cannot write there ({problem})")
