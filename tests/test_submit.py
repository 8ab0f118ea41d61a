"""``sweep.launcher=submitit``: sweep jobs submitted through submitit, as SLURM jobs or local processes.

SLURM is checked without a cluster: a fake ``srun``/``sbatch`` on PATH accept the job, and the batch script
submitit wrote must carry ``sweep.*``. The local cluster runs a real sweep through the CLI.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from ddptrain.app.submit import executor_parameters, submit
from ddptrain.config.compose import build_config
from ddptrain.config.schema import SweepConfig
from ddptrain.errors import ConfigError
from tests.helpers.cli import run_cli

pytest.importorskip("submitit")  # an optional extra: pip install 'ddptrain[submitit]'


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH on which ``srun`` exists and ``sbatch`` accepts every script as job 4242."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_sweep_keys_become_the_sbatch_script_of_a_single_node_job(fake_slurm: Path) -> None:
    cfg = SweepConfig(launcher="submitit", cluster="slurm", partition="gpu", gpus_per_node=8, cpus_per_task=16,
                      timeout_min=90, slurm_additional={"account": "proj"})
    (job,) = submit([["python", "-m", "ddptrain", "train.steps=5"]], cfg, fake_slurm / "submitit", {})
    assert job.job_id == "4242"
    script = job.paths.submission_file.read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --time=90", "#SBATCH --account=proj", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"):
        assert line in script, line


def test_unset_keys_are_left_to_the_cluster() -> None:
    assert executor_parameters(SweepConfig(), "s") == {"name": "s", "timeout_min": 60, "nodes": 1,
                                                       "tasks_per_node": 1, "gpus_per_node": 0}


def test_slurm_without_srun_is_a_one_line_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"sweep\.cluster=slurm: .*srun"):
        submit([["true"]], SweepConfig(launcher="submitit", cluster="slurm"), tmp_path, {})


def test_an_unknown_cluster_fails_at_composition() -> None:
    with pytest.raises(ConfigError, match=r"sweep\.cluster='pbs': expected one of auto, slurm, local"):
        build_config({"sweep": {"cluster": "pbs"}})


@pytest.mark.slow
def test_a_sweep_through_submitits_local_executor_trains_and_reports(tmp_path: Path) -> None:
    # job 0 cannot start (a micro batch of 3 does not divide the global batch of 2), job 1 trains
    tiny = ["data.max_documents=40", "train.steps=2", "train.log_every=1", "train.eval_every=0",
            "model.num_layers=1", "model.hidden_size=64", "data.global_batch_size=2", "checkpoint.export=false",
            "logger.progress=false"]
    args = ["-m", "data.micro_batch_size=3,2", *tiny, "sweep.launcher=submitit", "sweep.cluster=local",
            "hydra.sweep.dir=sweep"]
    result = run_cli(args, cwd=tmp_path, cache=tmp_path / "cache", timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "sweep job 1/2 submitted as job" in result.stderr
    assert "sweep job 0 failed: ddptrain: error: data.global_batch_size=2 is not divisible" in result.stderr
    rows = list(csv.DictReader((tmp_path / "sweep" / "sweep.csv").open()))
    assert [r["status"][:6] for r in rows] == ["failed", "ok"] and float(rows[1]["tokens_per_s"]) > 0
    assert (tmp_path / "sweep" / "1" / "summary.json").is_file()
    assert list((tmp_path / "sweep" / "submitit").glob("*_log.err"))
