"""Run the real ``ddptrain`` command (directly or under torchrun) as a subprocess, offline, with a test cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DDPTRAIN = [sys.executable, "-m", "ddptrain"]


def test_env(cache: Path, extra_env: dict | None = None) -> dict[str, str]:
    """The environment of a CLI run under test: offline, its own data cache, no inherited run dir or fault."""
    env = {**os.environ, "DDPTRAIN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": str(Path(__file__).parents[2])}
    # an in-process run of an earlier test points NCCL's dump into its own run dir: not this run's setting
    for key in ("DDPTRAIN_RUN_DIR", "DDPTRAIN_FAULT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        env.pop(key, None)
    return {**env, **(extra_env or {})}


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def cli_command(args: list[str], torchrun_nproc: int | None = None) -> list[str]:
    """The command line of ``ddptrain`` with ``args``, under torchrun when ``torchrun_nproc`` is given."""
    prefix = [*TORCHRUN, f"--nproc-per-node={torchrun_nproc}", "-m", "ddptrain"] if torchrun_nproc else DDPTRAIN
    return [*prefix, *args]


def run_cli(args: list[str], cwd: Path, cache: Path, timeout: float = 300, extra_env: dict | None = None,
            torchrun_nproc: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(args, torchrun_nproc), cwd=cwd, env=test_env(cache, extra_env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
