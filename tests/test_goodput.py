"""Goodput: the share of the wall-clock in productive steps, and where the rest went, adding up to 100 %; lost work
of killed attempts is counted from the attempts' records (kill/resume runs: test_reliability.py, test_elastic.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import ddptrain.telemetry.goodput as goodput_module
from ddptrain.telemetry.goodput import (
    RECORD_EVERY_S,
    REPORTED,
    Attempt,
    Goodput,
    account,
    goodput_line,
    read_attempts,
    redone_seconds,
)
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each

BASE = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 6, "log_every": 1, "eval_every": 3, "eval_batches": 2},
    "checkpoint": {"every_n_steps": 2},
}


def _adds_up(report: dict) -> None:
    g = report["goodput"]
    parts = report["goodput_pct"] + sum(g[f"{k}_pct"] for k in REPORTED)
    assert parts == pytest.approx(100.0, abs=1e-9), g
    seconds = g["productive_s"] + sum(g[f"{k}_s"] for k in REPORTED)
    assert seconds == pytest.approx(g["wall_clock_s"], rel=1e-12), g
    assert all(g[f"{k}_s"] >= 0 for k in ("productive", *REPORTED)), g


def test_a_run_with_eval_and_checkpoints_reports_goodput_and_buckets_that_add_up_to_its_wall_clock(
    tmp_path: Path,
) -> None:
    started = time.time()
    (run,) = run_distributed(train_each, 2, str(tmp_path), BASE, [{}])[0]
    elapsed = time.time() - started
    summary = run["summary"]
    _adds_up(summary)
    g = summary["goodput"]
    assert 0 < summary["goodput_pct"] < 100
    assert g["eval_s"] > 0 and g["checkpoint_s"] > 0 and g["startup_s"] > 0, g  # measured, not left over
    assert g["compile_s"] == 0 and g["restart_s"] == 0 and g["redone_steps_s"] == 0, g
    assert (g["attempts"], g["restarts"], g["redone_steps"], g["world_sizes"]) == (1, 0, 0, [2])
    # the wall-clock is the ranks' own (from rank 0's process start), inside what the test saw from outside,
    # and holds every logged step's time
    assert sum(m["step_time_s"] for m in run["metrics"]) < g["wall_clock_s"] < elapsed
    written = json.loads((Path(run["dir"]) / "summary.json").read_text())
    assert written["goodput_pct"] == summary["goodput_pct"]
    (record,) = json.loads((Path(run["dir"]) / "goodput.json").read_text())["attempts"]
    assert (record["resumed_from"], record["last_step"], sorted(record["productive_at"])) == (0, 6, ["2", "4", "6"])
    assert goodput_line(summary).startswith(f"goodput {summary['goodput_pct']:.1f}% of ")


def _attempt(started: float, span: float, resumed_from: int, last_step: int, restart: int = 0, launch: str = "a",
             productive: float = 4.0, productive_at: dict[str, float] | None = None) -> Attempt:
    """An attempt of ``span`` seconds: 1 s start-up, ``productive`` seconds of steps, 0.5 s saving."""
    seconds = {"startup": 1.0, "compile": 0.0, "checkpoint": 0.5, "eval": 0.0, "productive": productive}
    return Attempt(started, launch, restart, 2, resumed_from, last_step, started + span, seconds,
                   productive_at or {})


def test_steps_after_the_checkpoint_a_later_attempt_resumed_from_are_redone_work() -> None:
    # attempt 0: steps 1..6 (1 s each), saved at 4, recorded up to 6, then killed; an elastic restart resumes from 4
    first = _attempt(100.0, 8.0, 0, 6, productive=6.0, productive_at={"4": 4.0})
    second = _attempt(110.0, 4.0, 4, 8, restart=1, productive=2.0)
    report = account([first, second])
    _adds_up(report)
    g = report["goodput"]
    assert (g["redone_steps"], g["redone_steps_s"]) == (2, pytest.approx(2.0))  # steps 5 and 6, computed twice
    assert g["productive_s"] == pytest.approx(6.0)  # steps 1..4 of the first, 5..8 of the second
    assert (g["restarts"], g["restart_s"]) == (1, pytest.approx(2.0))  # 108 -> 110: recorded end to restart
    assert g["wall_clock_s"] == pytest.approx(14.0) and g["other_s"] == pytest.approx(0.5 + 0.5)


def test_a_manual_relaunch_leaves_the_time_between_launches_out_and_an_unrecorded_save_is_prorated() -> None:
    first = _attempt(100.0, 8.0, 0, 6, launch="a", productive=6.0)  # saved at 4, killed before recording it
    second = _attempt(1000.0, 4.0, 4, 8, launch="b", productive=2.0)
    report = account([first, second])
    _adds_up(report)
    g = report["goodput"]
    assert (g["restarts"], g["relaunches"], g["restart_s"]) == (0, 1, 0.0)
    assert g["between_launches_s"] == pytest.approx(892.0) and g["wall_clock_s"] == pytest.approx(12.0)
    assert g["redone_steps_s"] == pytest.approx(2.0)  # 2 of its 6 steps, in proportion


def test_an_attempt_that_resumed_before_every_step_of_an_earlier_one_loses_all_of_it() -> None:
    attempts = [_attempt(0.0, 7.0, 0, 6, productive_at={"2": 1.0}), _attempt(8.0, 6.0, 6, 7, restart=1),
                _attempt(15.0, 9.0, 2, 10, restart=2)]  # the checkpoint of 6 was lost: back to 2
    report = account(attempts)
    _adds_up(report)
    g = report["goodput"]
    assert g["redone_steps"] == (6 - 2) + (7 - 6)
    assert g["redone_steps_s"] == pytest.approx((4.0 - 1.0) + 4.0)


def test_an_unreadable_record_starts_the_account_again_instead_of_stopping_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = tmp_path / "goodput.json"
    record.write_text('{"attempts": [{"started": 1.0}]}')  # an attempt without its fields
    assert read_attempts(record) == [] and "unreadable" in caplog.text
    assert read_attempts(tmp_path / "absent.json") == []


def test_time_inside_a_step_goes_to_its_bucket_and_a_save_is_recorded_at_once_even_between_logging_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a clock the test moves: a step's eval and save are their buckets' time, not productive time; a step
    that saved writes the record right away (a kill before the next logging step must not lose the save), a step
    that neither saved nor logs waits for ``RECORD_EVERY_S``."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(goodput_module, "time", SimpleNamespace(time=lambda: clock.now))
    goodput = Goodput(90.0, tmp_path, is_main=True, world_size=2, resumed_from=0, earlier=False, compiles=False)

    def step(number: int, train_s: float, eval_s: float = 0.0, save_s: float = 0.0) -> None:
        goodput.step_started()
        clock.now += train_s
        with goodput.blocking("eval"):
            clock.now += eval_s
        with goodput.blocking("checkpoint"):
            clock.now += save_s
        goodput.step_ended(number, saved=save_s > 0, record=False)

    def recorded() -> dict:
        (attempt,) = json.loads((tmp_path / "goodput.json").read_text())["attempts"]
        return attempt

    step(1, train_s=1.0, eval_s=2.0, save_s=3.0)  # started at 100: 10 s of start-up
    assert goodput.attempt.seconds == {"startup": 10.0, "compile": 0.0, "checkpoint": 3.0, "eval": 2.0,
                                       "productive": 1.0, "recovery": 0.0}
    step(2, train_s=1.0)  # 1 s after the first record: nothing written
    assert recorded()["last_step"] == 1 and RECORD_EVERY_S > 2.0
    step(3, train_s=1.0, save_s=0.5)  # a save on a step that does not log
    assert (recorded()["last_step"], recorded()["productive_at"]) == (3, {"1": 1.0, "3": 3.0})
    assert recorded()["seconds"]["checkpoint"] == 3.5


def test_an_unrecorded_save_of_a_resumed_attempt_is_prorated_over_that_attempts_own_steps() -> None:
    # resumed from step 4, ran steps 5..10 (6 s), saved at 8 without recording it; a later attempt resumed from 8
    resumed = _attempt(100.0, 8.0, 4, 10, productive=6.0)
    assert redone_seconds(resumed, 8) == pytest.approx(2.0)  # 2 of its own 6 steps, not 2 of 10
    report = account([resumed, _attempt(110.0, 6.0, 8, 12, restart=1, productive=4.0)])
    _adds_up(report)
    assert (report["goodput"]["redone_steps"], report["goodput"]["redone_steps_s"]) == (2, pytest.approx(2.0))


@pytest.mark.parametrize("entry", ["launcher", "single process"])
def test_the_start_is_ddptrains_own_not_that_of_a_shell_which_ran_first_and_exec_d_it(entry: str) -> None:
    """``sh -c 'pip install ... && exec ddptrain ...'`` keeps the shell's PID, so the process's start is the
    shell's: the start-up goodput counts begins at ddptrain's first line, after the shell's work (a sleep here)."""
    import os
    import subprocess
    import sys

    read = ("float(g.launcher_start())" if entry == "launcher" else "g.attempt_start()")
    program = f"import ddptrain.telemetry.goodput as g; print(repr({read}))"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k != goodput_module.LAUNCH_START_ENV}
    out = subprocess.run(["sh", "-c", 'sleep 1.5; date +%s.%N; exec "$0" -c "$1"', sys.executable, program],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    before_exec, started = float(out[0]), float(out[1])
    assert started >= before_exec, f"the start {before_exec - started:.2f} s before the exec counts the shell's work"


def test_the_launchers_start_is_when_ddptrains_code_began_not_when_it_is_read() -> None:
    """The launcher reads its start only after composing and checking the config (seconds of ddptrain's own
    start-up, which goodput counts): the value is taken at ddptrain's first line, not when it is asked for."""
    import ddptrain

    asked = time.time()
    assert float(goodput_module.launcher_start()) == ddptrain.ENTERED_AT < asked


@pytest.mark.parametrize(("restarts", "from_launcher"), [("0", True), ("1", False)])
def test_a_workers_first_attempt_starts_at_the_launchers_start_and_a_restart_at_its_own(
    restarts: str, from_launcher: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of a launch's first attempt counts the launcher's start-up too (DDPTRAIN_LAUNCH_START); a
    restarted worker, spawned by torchrun's agent long after, starts at its own process's start."""
    monkeypatch.setattr(goodput_module, "_process_start_taken", False)
    monkeypatch.setenv(goodput_module.LAUNCH_START_ENV, "1000.5")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
    expected = 1000.5 if from_launcher else goodput_module.process_start()
    assert goodput_module.attempt_start() == pytest.approx(expected, abs=0.05)  # now less age: read twice


def test_a_forked_child_starts_at_the_fork_not_when_its_parent_imported_ddptrain() -> None:
    """A fork server's ranks (and a multiprocessing worker) begin at the fork: without the reset their goodput's
    start-up was the server's whole life (928 s of "start-up" in a suite that had run for 15 minutes)."""
    import os

    import ddptrain

    read, write = os.pipe()
    before_fork = time.time()
    pid = os.fork()
    if pid == 0:  # the child: report its start and leave without running pytest's teardown
        os.write(write, repr(ddptrain.ENTERED_AT).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child_entered = float(os.read(read, 64).decode())
    os.close(read)
    assert ddptrain.ENTERED_AT < before_fork <= child_entered
