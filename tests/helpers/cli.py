"""Run the real ``ddptrain`` command (directly or under torchrun) as a subprocess, as a user runs it: the console
scripts of this environment's install, from a directory outside the checkout, offline, with a test cache.

Nothing of the checkout is on the subprocess's path (no ``PYTHONPATH``, a working directory elsewhere), so the
command finds ``ddptrain``, its configs and its Hydra plugin only as the install laid them out: a packaging bug
(a package, package data or a namespace portion the install misses) fails here as it would for a user. A test
that must put one of its own helpers into the command's processes (the NCCL twin's ``sitecustomize``) adds that
helper's own directory, never the checkout's root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import procs

REPO = Path(__file__).parents[2]
BIN = Path(sys.executable).parent  # the console scripts of the environment the tests run in
# torchrun's own module, run by this interpreter (an environment made for a test, scripts/mutate.py's, holds
# ddptrain's console scripts but not torch's)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DDPTRAIN = [str(BIN / "ddptrain")]
DDPTRAIN_CKPT = [str(BIN / "ddptrain-ckpt")]


def test_env(cache: Path, extra_env: dict | None = None) -> dict[str, str]:
    """The environment of a CLI run under test: offline, its own data cache, nothing on ``PYTHONPATH``, no
    inherited run dir or fault."""
    env = {**os.environ, "DDPTRAIN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    # PYTHONPATH: the install alone; an in-process run of an earlier test points NCCL's dump into its own run
    # dir: not this run's setting
    for key in ("PYTHONPATH", "DDPTRAIN_RUN_DIR", "DDPTRAIN_FAULT", "TORCH_FR_DUMP_TEMP_FILE",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        env.pop(key, None)
    return {**env, **(extra_env or {})}


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def cli_command(args: list[str], torchrun_nproc: int | None = None) -> list[str]:
    """The command line of ``ddptrain`` with ``args``, under torchrun (``torchrun --no-python ddptrain``, as the
    README's) when ``torchrun_nproc`` is given."""
    prefix = [*TORCHRUN, f"--nproc-per-node={torchrun_nproc}", "--no-python", *DDPTRAIN] if torchrun_nproc \
        else DDPTRAIN
    return [*prefix, *args]


def outside_checkout(cwd: Path) -> Path:
    """``cwd``, refused when it lies in the checkout: run from there, the command would import the source tree
    (the working directory is on the path of ``python -c`` and of Hydra's plugin scan) instead of the install."""
    if Path(cwd).resolve().is_relative_to(REPO.resolve()):
        raise ValueError(f"a CLI test runs outside the checkout, not in {cwd}: use a temporary directory")
    return Path(cwd)


def run_cli(args: list[str], cwd: Path, cache: Path, timeout: float = 300, extra_env: dict | None = None,
            torchrun_nproc: int | None = None) -> subprocess.CompletedProcess[str]:
    """The run, to its end; on a timeout (or a failure while it runs) its whole tree is killed, workers included
    (``tests/helpers/procs.py``)."""
    return procs.run(cli_command(args, torchrun_nproc), cwd=outside_checkout(cwd), env=test_env(cache, extra_env),
                     capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
