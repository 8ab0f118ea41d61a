"""Nothing lost: exact resume after kills, elastic restarts, preemption, NaNs; an export (hangs: test_hangs.py).

What only the command can show runs through it: every kill (a real SIGKILL of a real worker, mid-step or
mid-save, and the launcher's line and exit code), torchrun's restart of a killed worker, SIGTERM of the launcher,
the exit code and single line of an aborted non-finite step. What the checkpoints those leave hold is shown by
training on from them as the command's workers do, in forked ranks (``tests/helpers/worker_run.py``: the same
composed config, the launcher's checks of the run dir before any worker, the worker's ``Trainer``), and by
comparing with the uninterrupted runs, trained the same way: a CLI run costs a launcher and a torch import per
rank (17-25 CPU s for 2 ranks), a forked one the training (3-6). 19 CLI runs became 9 (389 -> 277 CPU s, the
second figure on a busier machine).
"""

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
from filelock import FileLock
from safetensors.torch import load_file

from tests.helpers import procs
from tests.helpers.cli import DDPTRAIN, run_cli, test_env
from tests.helpers.run_cache import RunCache, shared_root
from tests.helpers.worker_run import train_as_the_command

pytestmark = pytest.mark.slow  # every test here runs the real CLI in several processes

RUN = ["launch.nproc_per_node=2", "train.steps=5", "train.log_every=1", "train.eval_every=0", "logger.progress=false",
       "data.max_documents=60", "data.global_batch_size=8", "data.micro_batch_size=2", "data.seq_len=64",
       "model.num_layers=2", "model.hidden_size=64", "checkpoint.every_n_steps=2"]
STRATEGIES = {"ddp": [], "zero1": ["parallel.zero_stage=1"], "zero3": ["parallel.zero_stage=3"]}
KILLS = {  # strategy -> faults, one per run, each run resuming the last: every strategy is killed mid-save (the
    # hardest case); DDP and ZeRO-3 first between steps, then mid-save in the run that resumed from that kill
    "ddp": ["kill@step:3", "kill@save:4"], "zero1": ["kill@save:4"], "zero3": ["kill@step:3", "kill@save:4"],
}
# One torch thread per worker in the command's runs, as each forked rank takes (tests/helpers/dist.py): the
# launcher gives a worker its share of the idle cores, which depends on the machine and its load, and a different
# thread count may sum a product in another order: the bitwise comparisons here need the same on both sides.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture
def cache(cli_runs: RunCache) -> Path:
    """The data cache every run here shares (with the session's cached runs): prepared once."""
    return cli_runs.data_cache


class Uninterrupted:
    """The uninterrupted reference run of each strategy, trained once per session (across pytest-xdist workers:
    a lock per strategy) as the command's workers train it (``train_as_the_command``), when a test first asks for it:
    kill, restart and resume cases all compare with these. Do not change them."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, strategy: str) -> Path:
        run_dir, trained = self.root / strategy, self.root / f"{strategy}.trained"
        with FileLock(str(run_dir) + ".lock"):
            if not trained.is_file():
                shutil.rmtree(run_dir, ignore_errors=True)
                train_as_the_command([*RUN, *STRATEGIES[strategy], f"hydra.run.dir={run_dir}"], self.cache)
                trained.touch()
        return run_dir


@pytest.fixture(scope="session")
def uninterrupted(cli_runs: RunCache, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Uninterrupted:
    return Uninterrupted(shared_root(tmp_path_factory, worker_id).parent / "reliability-uninterrupted",
                         cli_runs.data_cache)


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
        killed = run_cli([*args, *resume], cwd=tmp_path, cache=cache, extra_env={**ONE_THREAD, "DDPTRAIN_FAULT": fault})
        assert killed.returncode != 0 and "ddptrain: error: rank 0 (host " in killed.stderr, killed.stderr[-3000:]
        assert "died of SIGKILL" in killed.stderr
        assert not attempt or "step_000002 at step 2" in killed.stderr  # the kill before cost only steps 3, 4
        checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert checkpoints == (["step_000002"] if fault.startswith("kill@step") else
                               [".tmp-step_000004", "step_000002"]), (fault, checkpoints)
    resumed = train_as_the_command([*args, "train.resume=auto"], cache)  # what the last kill left, trained on
    assert "resumed from" in resumed and "step 2" in resumed, resumed[-3000:]
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
    killed = run_cli(args, cwd=tmp_path, cache=cache, extra_env={**ONE_THREAD, "DDPTRAIN_FAULT": "kill@save:4"})
    assert killed.returncode != 0 and "ddptrain: error: rank 0 (host " in killed.stderr
    assert "died of SIGKILL" in killed.stderr
    assert "step_000002 (training blocked" in killed.stderr and "background write" in killed.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".tmp-step_000004", "step_000002"]
    resumed = train_as_the_command([*args, "train.resume=auto"], cache)
    assert "resumed from" in resumed and "step_000002 at step 2" in resumed, resumed[-3000:]
    _assert_bitwise_equal(uninterrupted["ddp"], tmp_path)


def test_sigkilled_worker_is_restarted_and_the_run_completes(
    tmp_path: Path, cache: Path, uninterrupted: Uninterrupted
) -> None:
    result = run_cli([*RUN, "launch.max_restarts=1", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, cache=cache,
                     extra_env={**ONE_THREAD, "DDPTRAIN_FAULT": "kill@step:3:1"})
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
    resumed = train_as_the_command([*RUN, f"train.steps={step + 1}", "train.resume=auto", f"hydra.run.dir={tmp_path}"],
                             cache)
    assert f"at step {step}" in resumed, resumed[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == step + 1


@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_non_finite_loss_is_decided_alike_on_every_rank(tmp_path: Path, cache: Path, policy: str) -> None:
    """Rank 1's step-3 loss poisoned: every rank skips the update, or every rank stops. ``skip`` trains on in
    forked ranks (the command adds nothing to a run that ends well); ``abort``'s exit code and its one line are
    the command's, with a restart left (launch.max_restarts=1): torch's agent restarts the aborted workers, which
    end at once with the same code and say nothing (``app/settled.py``)."""
    args = [*RUN, f"train.nan_policy={policy}", f"hydra.run.dir={tmp_path}"]
    if policy == "skip":
        said = train_as_the_command(args, cache, fault="nan@step:3:1")
        assert "update skipped on every rank" in said, said[-3000:]
        assert '"skipped_steps": 1' in (tmp_path / "metrics.jsonl").read_text()
    else:
        result = run_cli([*args, "launch.max_restarts=1"], cwd=tmp_path, cache=cache,
                         extra_env={"DDPTRAIN_FAULT": "nan@step:3:1"})
        assert result.returncode == 3, result.stderr[-3000:]  # the workers' own code
        lines = [ln for ln in result.stderr.splitlines() if "non-finite loss or gradients at step 3" in ln]
        assert len([ln for ln in lines if ln.startswith("ddptrain:")]) == 1, result.stderr[-3000:]  # rank 0's
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
        # torch's agent logs each attempt's first failed worker: the abort and its restart both exited 3
        assert (tmp_path / "train.log").read_text().count("failed (exitcode: 3)") == 2


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
    said = train_as_the_command([*RUN, "launch.nproc_per_node=1", "train.steps=6", "train.resume=auto",
                           f"hydra.run.dir={run}"], cache)
    assert "resuming on 1 ranks from a checkpoint of 2: grad_accum 4 keeps the global batch of 8" in said, said
    assert "step_000005 at step 5" in said
