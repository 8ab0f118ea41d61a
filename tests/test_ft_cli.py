"""Replica groups (torchft) through the real command: 3 groups of 1 worker train as one 3-rank DDP run; a group
killed mid-run is restarted by its own agent and heals from a peer while the others keep stepping; a lighthouse
that dies stops the run with one line, its checkpoints kept. The fast checks are in tests/test_ft.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest

from ddptrain.checkpoint.offline import read_tensors, tensor_entries
from ddptrain.ft.accounting import read_events
from tests.helpers import procs
from tests.helpers.cli import cli_command, outside_checkout, run_cli, test_env
from tests.helpers.run_cache import Ran, RunCache
from tests.helpers.worker_run import reference_losses, train_groups_as_the_command

pytestmark = pytest.mark.slow  # every test here runs the real CLI: a lighthouse and several groups of workers

STEPS = 20  # the kill test's: a save and a kill at 5, the survivors alone 6-9, a wait at 10, ten steps to rejoin
RUN = ["model=llama_tiny", "data.max_documents=40", f"train.steps={STEPS}", "train.log_every=1",
       "train.eval_every=0", "data.global_batch_size=6", "data.micro_batch_size=2", "checkpoint.export=false",
       "logger.progress=false", "hydra.run.dir=run"]
GROUPS = ["ft.replica_groups=3"]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def model_tensors(checkpoint: Path) -> dict:
    keys = [k for k in tensor_entries(checkpoint) if k.startswith("model.")]
    return read_tensors(checkpoint, keys)


DRIFT = ["model=llama_tiny", "data.max_documents=40", "train.steps=6", "train.log_every=2", "train.check_every=1",
         "train.eval_every=0", "data.global_batch_size=8", "data.micro_batch_size=2", "checkpoint.export=false",
         "logger.progress=false", "ft.replica_groups=2", "ft.min_replicas=2", "launch.nproc_per_node=2",
         "train.drift_policy=rebroadcast"]
DRIFT_FAULT = "drift@step:3:1/1"


def drift_run(run_dir: Path, cache: Path) -> Path:
    """The drift test's run, its groups' workers in forked ranks under a lighthouse in this process
    (``train_groups_as_the_command``): the check and its repair are the workers', inside their group's process
    group; the launcher, the agents and the lighthouse's process are what the other tests here guard. The run dir."""
    train_groups_as_the_command([*DRIFT, f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}"], cache, DRIFT_FAULT)
    return run_dir


@pytest.fixture(scope="module")
def background(request: pytest.FixtureRequest, cli_runs: RunCache,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    """The module's runs that nothing here times, started at once beside the no-fault run: the 3-rank DDP
    reference (its losses and summary) and the drift run (its run dir). A replica-group run spends half its wall
    time waiting (the lighthouse's quorum each step, the groups' start-up in turn), so these train in its pauses.
    Each test reads its run (``.result()``). Neither is what the launcher's tests guard: both train in forked ranks
    (``tests/helpers/worker_run.py``; the reference a few CPU s instead of 23 through the command; the drift run's
    two groups of two ranks 18 CPU s alone at load 10, and the first test, which carries both runs beside the
    no-fault one, went from 111 to 62 CPU s when the drift run left the command and the steps went from 30 to 20).
    The kill test, whose verdict depends on when the killed group's restart lands, runs alone after them."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    with ThreadPoolExecutor(max_workers=2) as pool:  # leaving the module waits for both (each has its timeout)
        runs: dict[str, Future[Any]] = {}
        if test_three_groups_of_one_worker_train_as_one_three_rank_ddp_run.__name__ in selected:
            runs["ddp"] = pool.submit(reference_losses, RUN, 3, tmp_path_factory.mktemp("ddp") / "run",
                                      cli_runs.data_cache)
        if test_the_drift_check_works_inside_a_group_and_repairs_only_that_group.__name__ in selected:
            runs["drift"] = pool.submit(drift_run, tmp_path_factory.mktemp("drift") / "run", cli_runs.data_cache)
        yield runs  # only what a test reads


@pytest.fixture(scope="module")
def no_fault(cli_runs: RunCache, background: dict[str, Future[Any]]) -> Path:
    """3 groups x 1 worker, all of them in every step (ft.min_replicas=3): the run dir."""
    ran = cli_runs.run([*RUN, *GROUPS, "ft.min_replicas=3"], timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.run_dir


def test_three_groups_of_one_worker_train_as_one_three_rank_ddp_run(no_fault: Path,
                                                                     background: dict[str, Future[Any]]) -> None:
    expected, _ = background["ddp"].result()
    ft = json.loads((no_fault / "ft.json").read_text())
    assert ft["quorum_per_step"] == [[1, STEPS, 3]]  # the groups met in every step: the feature was on
    assert [g["steps"] for g in ft["replica_groups"]] == [[[1, STEPS]]] * 3
    assert len(expected) == STEPS
    for group in range(3):  # each group logs the loss over all three (it rides in the gradients' all-reduce)
        got = losses(no_fault / f"group{group}")
        assert got.keys() == expected.keys()
        worst = max(abs(got[s] - expected[s]) for s in expected)
        assert worst <= 1e-5, f"group {group}: largest loss difference {worst:.2e}"
    assert losses(no_fault / "group0")[STEPS] < losses(no_fault / "group0")[1]  # it trained
    summary = json.loads((no_fault / "summary.json").read_text())
    assert summary["ft"]["quorum_per_step"] == [[1, STEPS, 3]]


def test_a_killed_group_is_restarted_alone_and_heals_from_a_peer_while_the_others_keep_stepping(
        cli_runs: RunCache, no_fault: Path, background: dict[str, Future[Any]], tmp_path: Path) -> None:
    wait(background.values())  # alone on its worker's share of the machine
    # Staged by gates (wait faults, each opened by its own file in `gates`), so that no step of it depends on how
    # fast the machine starts the groups: every group's rank 0 waits at step 1 until all three groups are in (their
    # "attempt" events), so all three take step 5 (a group that started late joined at a later step by a heal, and
    # skipped the kill at step 5: all three then waited at step 10 for a restart that never came, 600 s in CI).
    # Group 1's rank 0 dies after step 5 (its checkpoint saved). The survivors step on without it, then wait at
    # step 10 until group 1's restarted workers have resumed from that checkpoint (their "attempt" event, written
    # just before their first quorum), so the restart lands before the run ends however slow the machine is; every
    # group's first attempt also sleeps 1.5 s a step, which leaves the rejoining group ten steps to reach the
    # quorum after the release
    gates, cwd = tmp_path / "gates", tmp_path / "cwd"
    gates.mkdir()
    cwd.mkdir()
    fault = {"DDPTRAIN_FAULT": "wait@data:1:0,kill@step:5:1/0,delay@data:1:0:1500,wait@data:10:0",
             "DDPTRAIN_FAULT_RELEASE": str(gates)}
    skipped: list[dict] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(run_cli, [*RUN, *GROUPS, "ft.min_replicas=2", "checkpoint.every_n_steps=5"],
                              cwd=cwd, cache=cli_runs.data_cache, timeout=600, extra_env=fault)
        while not running.done():
            events = {g: read_events(cwd / "run" / "ft" / f"group{g}.jsonl") for g in range(3)}
            attempts = [[e for e in events[g] if e.get("event") == "attempt"] for g in range(3)]
            if all(attempts) and not (gates / "1").exists():
                (gates / "1").touch()
            if len(attempts[1]) == 2:
                (gates / "10").touch()
                break
            # the staging failed if group 1's first attempt got past step 5 alive: open the last gate so the run
            # ends and the failure says so, instead of every group waiting at step 10 until the timeout
            skipped = [e for e in events[1] if e.get("event") in ("step", "heal") and e["step"] > 5]
            if skipped:
                (gates / "10").touch()
                break
            time.sleep(0.2)
        done = running.result()
    assert not skipped, f"group 1's first attempt went past step 5 without its kill: {skipped[:2]}"
    assert (gates / "10").exists(), f"group 1 never restarted: {done.stderr[-3000:]}"
    ran = Ran(cwd, done.returncode, done.stdout, done.stderr)
    assert ran.returncode == 0, ran.stderr[-3000:]
    ft = json.loads((ran.run_dir / "ft.json").read_text())
    g0, g1, g2 = ft["replica_groups"]
    assert (g0["attempts"], g1["attempts"], g2["attempts"]) == (1, 2, 1)
    heals = [h for h in g1["heals"] if h["step"] > 5]
    assert heals, f"group 1 did not heal after its restart: {g1}"
    rejoined = heals[-1]["step"]
    assert g1["steps"][-1] == [rejoined, STEPS] and g2["steps"][-1][1] == STEPS
    # the survivors stepped without group 1 between its death and its return, then all three again. Read per step:
    # a group whose process is slow after the gate at step 1 can still miss a first quorum (ft.min_replicas=2 lets
    # two start; the lighthouse waits 2 s for a third), which merges with the survivors' steps
    size = {s: n for first, last, n in ft["quorum_per_step"] for s in range(first, last + 1)}
    assert rejoined > 6 and all(size[s] == 2 for s in range(6, rejoined)), ft["quorum_per_step"]
    assert ft["quorum_per_step"][-1] == [rejoined, STEPS, 3]
    # group 1's weights equal the others' bit for bit at the step it next saved (its state is a peer's copy)
    saved = f"checkpoints/step_{STEPS:06d}"
    reference = model_tensors(ran.run_dir / "group0" / saved)
    for group in (1, 2):
        theirs = model_tensors(ran.run_dir / f"group{group}" / saved)
        assert theirs.keys() == reference.keys()
        assert all(theirs[k].equal(reference[k]) for k in reference), f"group {group}'s weights differ"
    final, expected = losses(ran.run_dir / "group0")[STEPS], losses(no_fault / "group0")[STEPS]
    assert abs(final - expected) <= 0.05 * expected, (final, expected)


def test_a_lighthouse_gone_stops_every_group_with_one_line_and_keeps_the_checkpoints(
        cli_runs: RunCache, tmp_path: Path) -> None:
    cwd = outside_checkout(tmp_path)
    args = ["model=llama_tiny", "data.max_documents=40", "train.steps=200", "train.log_every=5", "train.eval_every=0",
            "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.export=false", "logger.progress=false",
            "checkpoint.every_n_steps=5", "ft.replica_groups=2", "ft.min_replicas=2",
            f"hydra.run.dir={tmp_path / 'run'}"]
    env = test_env(cli_runs.data_cache, {"DDPTRAIN_FAULT": "delay@data:1:0:300"})
    err = tmp_path / "stderr"
    with err.open("w") as out:
        proc = procs.start(cli_command(args), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=out,
                           stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while "step 10/" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)
        lighthouse = json.loads((tmp_path / "run" / "ft" / "lighthouse.json").read_text())
        os.kill(lighthouse["pid"], signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=120)
    took = time.monotonic() - killed
    lines = err.read_text().splitlines()
    assert code == 1
    assert took < 60, f"{took:.0f} s from the lighthouse's death to the end"
    errors = [line for line in lines if line.startswith("ddptrain:")]
    assert len(errors) == 1 and "the torchft lighthouse exited" in errors[0], errors
    for group in (0, 1):
        committed = sorted((tmp_path / "run" / f"group{group}" / "checkpoints").glob("step_*/COMMITTED"))
        assert committed and committed[-1].parent.name >= "step_000010", committed


def test_a_run_stopped_for_want_of_a_quorum_continues_with_resume_auto_as_its_line_says(
        cli_runs: RunCache, tmp_path: Path) -> None:
    """Group 1's only worker dies after step 3 and is not restarted (ft.group_restarts=0): group 0 finds no quorum
    of two groups before step 4 and the run stops, its line saying to continue with train.resume=auto. Continued
    in the same run dir, the launch trains to the end: the earlier launch's quorum loss, still in the event files
    the continued groups append to, is not this launch's (it stopped the continued run at its first poll)."""
    args = ["model=llama_tiny", "data.max_documents=40", "train.steps=6", "train.log_every=1", "train.eval_every=0",
            "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.export=false", "logger.progress=false",
            "checkpoint.every_n_steps=2", "ft.replica_groups=2", "ft.min_replicas=2", "ft.group_restarts=0",
            "ft.quorum_timeout_s=5", f"hydra.run.dir={tmp_path / 'run'}"]
    stopped = run_cli(args, cwd=tmp_path, cache=cli_runs.data_cache, timeout=300,
                      extra_env={"DDPTRAIN_FAULT": "kill@step:3:1/0"})
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("ddptrain: error: replica group")]
    assert stopped.returncode == 1 and len(errors) == 1, stopped.stderr[-3000:]
    assert "found no quorum" in errors[0] and "before step 4" in errors[0] and "train.resume=auto" in errors[0]
    # one line for the stop: the groups' launcher's (group 0's worker, which timed out, says none of its own)
    said = [line for line in stopped.stderr.splitlines() if line.startswith("ddptrain:") and "quorum" in line]
    assert said == errors, stopped.stderr[-3000:]
    continued = run_cli([*args, "train.resume=auto"], cwd=tmp_path, cache=cli_runs.data_cache, timeout=300)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert "found no quorum" not in continued.stderr
    for group in (0, 1):
        events = read_events(tmp_path / "run" / "ft" / f"group{group}.jsonl")
        assert [e["attempt"] for e in events if e.get("event") == "attempt"] == [0, 0]  # one of each launch
        assert max(e["step"] for e in events if e.get("event") == "step" and e.get("committed")) == 6


def test_the_drift_check_works_inside_a_group_and_repairs_only_that_group(
        background: dict[str, Future[Any]]) -> None:
    """2 groups of 2 workers; rank 1 of group 1 drifts after step 3's update. Group 1's check at step 3 names its
    rank 1 and re-broadcasts from its rank 0 (the drift check runs on the group's own process group); group 0 sees
    nothing; at the end both groups hold the same weights (the cross-group average kept them together)."""
    run_dir = background["drift"].result()  # every rank of both groups ended without an error
    drift = "replicas differ at step 3 (equal at step 2): rank 1 differs from rank 0"
    assert drift in (run_dir / "group1" / "train.log").read_text()
    assert "replicas differ" not in (run_dir / "group0" / "train.log").read_text()
    saved = "checkpoints/step_000006"
    g0, g1 = (model_tensors(run_dir / f"group{g}" / saved) for g in (0, 1))
    assert g0.keys() == g1.keys() and all(g0[k].equal(g1[k]) for k in g0)
