"""Nothing lost: exact resume after kills, elastic restarts, preemption, NaNs; an export (hangs: test_hangs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import procs
from tests.helpers.cli import DDPTRAIN, run_cli, test_env
from tests.helpers.run_cache import RunCache

pytestmark = pytest.mark.slow  # every test here runs the real CLI in several processes

RUN = ["launch.nproc_per_node=2", "train.steps=5", "train.log_every=1", "train.eval_every=0", "logger.progress=false",
       "data.max_documents=60", "data.global_batch_size=8", "data.micro_batch_size=2", "data.seq_len=64",
       "model.num_layers=2", "model.hidden_size=64", "checkpoint.every_n_steps=2"]
STRATEGIES = {"ddp": [], "zero1": ["parallel.zero_stage=1"], "zero3": ["parallel.zero_stage=3"]}
KILLS = {  # strategy -> faults, one per run, each run resuming the last: every strategy is killed mid-save (the
    # hardest case); DDP and ZeRO-3 first between steps, then mid-save in the run that resumed from that kill
    "ddp": ["kill@step:3", "kill@save:4"], "zero1": ["kill@save:4"], "zero3": ["kill@step:3", "kill@save:4"],
}


@pytest.fixture
def cache(cli_runs: RunCache) -> Path:
    """The data cache every run here shares (with the session's cached runs): prepared once."""
    return cli_runs.data_cache


class Uninterrupted:
    """The uninterrupted reference run of each strategy, run once per session (``tests/helpers/run_cache.py``),
    when a test first asks for it: kill, restart and resume cases all compare with these. Do not change them."""

    def __init__(self, cli_runs: RunCache) -> None:
        self.cli_runs = cli_runs

    def __getitem__(self, strategy: str) -> Path:
        result = self.cli_runs.run([*RUN, *STRATEGIES[strategy], "hydra.run.dir=run"])
        assert result.returncode == 0, result.stderr[-3000:]
        return result.run_dir


@pytest.fixture
def uninterrupted(cli_runs: RunCache) -> Uninterrupted:
    return Uninterrupted(cli_runs)


def _weights(run: Path) -> dict:
    return load_file(run / "model" / "model.safetensors")


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not (wa[k] == wb[k]).all()]
    assert not different, f"weights differ after resume: {different[:5]}"


@pytest.mark.parametrize("strategy", list(KILLS), ids=[f"{s}-{'-then-'.join(f)}" for s, f in KILLS.items()])
def test_kill_and_resume_is_bitwise_equal_to_uninterrupted(
    tmp_path: Path, cache: Path, uninterrupted: Uninterrupted, strategy: str
) -> None:
    args = [*RUN, *STRATEGIES[strategy], f"hydra.run.dir={tmp_path}"]
    for attempt, fault in enumerate(KILLS[strategy]):
        resume = ["train.resume=auto"] if attempt else []
        killed = run_cli([*args, *resume], cwd=tmp_path, cache=cache, extra_env={"DDPTRAIN_FAULT": fault})
        assert killed.returncode != 0 and "ddptrain: error: rank 0 (host " in killed.stderr, killed.stderr[-3000:]
        assert "died of SIGKILL" in killed.stderr
        assert not attempt or "step_000002 at step 2" in killed.stderr  # the kill before cost only steps 3, 4
        checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert checkpoints == (["step_000002"] if fault.startswith("kill@step") else
                               [".tmp-step_000004", "step_000002"]), (fault, checkpoints)
    resumed = run_cli([*args, "train.resume=auto"], cwd=tmp_path, cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "a partial save must be cleaned"
    _assert_bitwise_equal(uninterrupted[strategy], tmp_path)
    # goodput: each launch an attempt; step 3, computed by the attempt killed saving step 4, was redone
    goodput = json.loads((tmp_path / "summary.json").read_text())["goodput"]
    launches = len(KILLS[strategy]) + 1
    assert (goodput["attempts"], goodput["relaunches"], goodput["restarts"]) == (launches, launches - 1, 0)
    assert goodput["redone_steps"] == 1 and goodput["redone_steps_s"] > 0, goodput


def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint_latest(
    tmp_path: Path, cache: Path, uninterrupted: Uninterrupted
) -> None:
    args = [*RUN, "checkpoint.async_save=true", f"hydra.run.dir={tmp_path}"]
    killed = run_cli(args, cwd=tmp_path, cache=cache, extra_env={"DDPTRAIN_FAULT": "kill@save:4"})
    assert killed.returncode != 0 and "ddptrain: error: rank 0 (host " in killed.stderr
    assert "died of SIGKILL" in killed.stderr
    assert "step_000002 (training blocked" in killed.stderr and "background write" in killed.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".tmp-step_000004", "step_000002"]
    resumed = run_cli([*args, "train.resume=auto"], cwd=tmp_path, cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_000002 at step 2" in resumed.stderr
    _assert_bitwise_equal(uninterrupted["ddp"], tmp_path)


def test_sigkilled_worker_is_restarted_and_the_run_completes(
    tmp_path: Path, cache: Path, uninterrupted: Uninterrupted
) -> None:
    result = run_cli([*RUN, "launch.max_restarts=1", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, cache=cache,
                     extra_env={"DDPTRAIN_FAULT": "kill@step:3:1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restarted by the elastic agent" in result.stderr and "resumed from" in result.stderr
    _assert_bitwise_equal(uninterrupted["ddp"], tmp_path)
    # goodput: the restart's gap counts; rank 0 never recorded step 3 (its loss mean waited for the dead rank)
    goodput = json.loads((tmp_path / "summary.json").read_text())["goodput"]
    assert (goodput["attempts"], goodput["restarts"], goodput["redone_steps"]) == (2, 1, 0), goodput
    assert goodput["restart_s"] > 0 and goodput["restart_pct"] > 0
    logged = [line for line in result.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert logged[-1][9:].startswith("goodput "), logged[-3:]  # the run's last log line


def test_sigterm_of_the_launcher_leaves_a_loadable_checkpoint(tmp_path: Path, cache: Path) -> None:
    args = [*RUN, "train.steps=100000", "checkpoint.every_n_steps=0", f"hydra.run.dir={tmp_path}"]
    proc = procs.start([*DDPTRAIN, *args], cwd=tmp_path, env=test_env(cache), stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "checkpoint saved" in stderr and "continue with train.resume=auto" in stderr
    (saved,) = (tmp_path / "checkpoints").glob("step_*")
    step = int(saved.name.split("_")[1])
    resumed = run_cli([*RUN, f"train.steps={step + 1}", "train.resume=auto", f"hydra.run.dir={tmp_path}"],
                      cwd=tmp_path, cache=cache)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_non_finite_loss_is_decided_alike_on_every_rank(tmp_path: Path, cache: Path, policy: str) -> None:
    args = [*RUN, f"train.nan_policy={policy}", f"hydra.run.dir={tmp_path}"]
    result = run_cli(args, cwd=tmp_path, cache=cache, extra_env={"DDPTRAIN_FAULT": "nan@step:3:1"})
    if policy == "skip":
        assert result.returncode == 0, result.stderr[-3000:]
        assert "update skipped on every rank" in result.stderr
        assert '"skipped_steps": 1' in (tmp_path / "metrics.jsonl").read_text()
    else:
        assert result.returncode == 3, result.stderr[-3000:]  # the workers' own code
        lines = [ln for ln in result.stderr.splitlines() if "non-finite loss or gradients at step 3" in ln]
        assert len([ln for ln in lines if ln.startswith("ddptrain:")]) == 1, result.stderr[-3000:]  # rank 0's
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


def test_export_loads_with_transformers_alone(uninterrupted: Uninterrupted) -> None:
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(uninterrupted['zero3'] / 'model')!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(uninterrupted['zero3'] / 'model')!r})\n"
        "ids = t('def main():', return_tensors='pt').input_ids\n"
        "print(m(input_ids=ids).logits.shape[-1]); assert 'ddptrain' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) >= 8192 // 2


def test_resume_on_another_world_size_keeps_the_global_batch(tmp_path: Path, cache: Path,
                                                             uninterrupted: Uninterrupted) -> None:
    run = tmp_path / "run"
    shutil.copytree(uninterrupted["ddp"], run)  # 5 steps on 2 ranks, checkpoints of steps 4 and 5
    more = run_cli([*RUN, "launch.nproc_per_node=1", "train.steps=6", "train.resume=auto", f"hydra.run.dir={run}"],
                   cwd=tmp_path, cache=cache)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resuming on 1 ranks from a checkpoint of 2: grad_accum 4 keeps the global batch of 8" in more.stderr
    assert "step_000005 at step 5" in more.stderr
