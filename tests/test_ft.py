"""Replica groups (torchft), the fast part: the fault grammar's G/R, ft.json from the groups' events, the data
split by group, the goodput of a heal, and the one-line refusals (the missing extra, the keys it cannot run with).
The runs themselves are in tests/test_ft_cli.py (slow)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.ft.accounting import ranges, write_ft_json
from ddptrain.ft.layout import data_parallel_rank, data_parallel_size, events_path
from ddptrain.ft.supervise import group_argv
from ddptrain.runtime.hooks import StepHooks
from ddptrain.telemetry.goodput import Goodput, account
from ddptrain.testing.faults import Fault, Faults, parse_fault, step_hooks


def test_a_fault_names_a_rank_of_one_replica_group_and_fires_there_in_that_groups_first_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert parse_fault("kill@step:10:1/0") == (Fault("kill", "step", 10), (1, 0))
    assert parse_fault("kill@step:10:2") == (Fault("kill", "step", 10), 2)  # a plain rank: as before
    monkeypatch.setenv("DDPTRAIN_FAULT", "kill@step:10:1/0")
    assert step_hooks(0, 1) == Fault("kill", "step", 10)
    for rank, group in ((0, 0), (0, 2), (1, 1), (0, None)):  # another group, another rank, no groups at all
        assert type(step_hooks(rank, group)) is StepHooks
    monkeypatch.setenv("DDPTRAIN_FAULT", "kill@step:10:0")  # a plain rank strikes that rank of every group
    assert step_hooks(0, 2) == Fault("kill", "step", 10) and step_hooks(0, None) == Fault("kill", "step", 10)
    monkeypatch.setenv("DDPTRAIN_FAULT", "kill@step:10:1/0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the group's own agent restarted it
    assert type(step_hooks(0, 1)) is StepHooks


def test_several_faults_in_one_spec_each_strike_their_own_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("DDPTRAIN_FAULT", "kill@step:10:1/0,delay@data:11:0:1000")
    assert step_hooks(0, 1) == Faults((Fault("kill", "step", 10), Fault("delay", "data", 11, 1000.0)))
    assert step_hooks(0, 0) == Fault("delay", "data", 11, 1000.0)
    assert type(step_hooks(1, 0)) is StepHooks


@pytest.mark.parametrize("spec", ["kill@step:10:x/0", "kill@step:10:1/", "kill@step:10:-1/0", "kill@step:10:1/0,oops"])
def test_a_group_rank_that_does_not_parse_is_one_line(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv("DDPTRAIN_FAULT", spec)
    with pytest.raises(ConfigError, match=r"^DDPTRAIN_FAULT=.*expected"):
        step_hooks(0, 0)


def _events(run_dir: Path, group: int, *records: dict) -> None:
    path = events_path(run_dir, group)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "st')  # a line cut by a kill


def test_ft_json_holds_each_groups_attempts_heals_and_steps_and_each_steps_quorum(tmp_path: Path) -> None:
    def steps(first: int, last: int, quorum: int, committed: bool = True) -> list[dict]:
        return [{"event": "step", "step": s, "quorum": quorum, "committed": committed} for s in range(first, last + 1)]

    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, *steps(1, 10, 3), *steps(11, 11, 3, committed=False),
            *steps(11, 14, 2), *steps(15, 20, 3))
    _events(tmp_path, 1, {"event": "attempt", "attempt": 0}, *steps(1, 10, 3), {"event": "attempt", "attempt": 1},
            {"event": "heal", "step": 15, "seconds": 1.5}, *steps(15, 20, 3))
    record = write_ft_json(tmp_path, 3)  # group 2 wrote nothing (it never started)
    assert json.loads((tmp_path / "ft.json").read_text()) == record
    g0, g1, g2 = record["replica_groups"]
    assert g0 == {"replica_id": 0, "attempts": 1, "heals": [], "steps": [[1, 20]], "steps_not_committed": [11]}
    assert g1 == {"replica_id": 1, "attempts": 2, "heals": [{"step": 15, "seconds": 1.5}],
                  "steps": [[1, 10], [15, 20]], "steps_not_committed": []}
    assert g2["attempts"] == 0 and g2["steps"] == []
    assert record["quorum_per_step"] == [[1, 10, 3], [11, 14, 2], [15, 20, 3]]
    assert record["quorum_lost"] == []
    assert ranges([7, 1, 2, 3, 2]) == [[1, 3], [7, 7]]


def test_the_global_batch_is_split_over_every_rank_of_every_group(compose: Callable[..., Config]) -> None:
    from ddptrain.data import BatchShape

    cfg = compose("ft.replica_groups=3", "ft.replica_id=2", "data.global_batch_size=12", "data.micro_batch_size=2")
    assert data_parallel_size(cfg, 2) == 6 and BatchShape.from_config(cfg, 6).grad_accum == 1
    assert [data_parallel_rank(cfg, r, 2) for r in (0, 1)] == [4, 5]  # group 2's ranks: after groups 0 and 1's
    plain = compose("data.global_batch_size=12", "data.micro_batch_size=2")
    assert data_parallel_size(plain, 2) == 2 and data_parallel_rank(plain, 1, 2) == 1


def test_a_group_runs_in_the_run_dir_given_to_it_whatever_the_user_set() -> None:
    argv = group_argv(["model=llama_tiny", "hydra.run.dir=x", "ft.replica_groups=3", "ft.replica_id=0"],
                      Path("/runs/a"), 2, "http://localhost:1")
    assert argv == ["model=llama_tiny", "ft.replica_groups=3", "hydra.run.dir=/runs/a", "ft.replica_id=2",
                    "ft.lighthouse=http://localhost:1"]


def test_a_heal_is_recovery_and_the_steps_it_skipped_are_not_redone(tmp_path: Path) -> None:
    first = Goodput(100.0, tmp_path, True, 1, 0, False, False)
    first.attempt.seconds["productive"], first.attempt.last_step, first.attempt.recorded_at = 5.0, 10, 106.0
    first.attempt.productive_at = {"5": 2.5}
    healed = Goodput(120.0, tmp_path, True, 1, 0, False, False)
    healed.earlier = [first.attempt]
    healed.attempt.restart, healed.attempt.launch = 1, first.attempt.launch
    healed.step_started()
    startup = healed.attempt.seconds["startup"]
    healed.recovered(2.0, 24)  # its first step: the copy from a peer, made before it, was counted as start-up
    assert startup - healed.attempt.seconds["startup"] == pytest.approx(2.0)  # ... and is taken out of it
    assert healed.attempt.seconds["recovery"] == 2.0 and healed.attempt.resumed_from == 24
    report = account([first.attempt, healed.attempt])
    assert report["goodput"]["recovery_s"] == 2.0
    assert report["goodput"]["redone_steps"] == 0  # the first attempt's 10 steps stay productive
    assert report["goodput"]["productive_s"] == 5.0


def test_without_the_extra_a_run_with_replica_groups_is_one_line_naming_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ddptrain.app.cli import run_cli

    monkeypatch.setitem(sys.modules, "torchft", None)  # importlib.util.find_spec: not installed
    assert run_cli(["ft.replica_groups=2", "model=llama_tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddptrain: error: ft.replica_groups=2 needs torchft, which is not installed: "
                   "pip install 'ddptrain[ft]'"]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["parallel.engine=bucketed"], "ft.replica_groups=2 cannot be combined with parallel.engine=bucketed"),
    (["parallel.zero_stage=1"], "parallel.zero_stage=1: replica groups train torch DDP"),
    (["ft.sync=diloco", "optim.impl=foreach"], "ft.sync=diloco cannot be combined with optim.impl=foreach"),
    (["ft.sync=streaming_diloco", "ft.fragments=2", "optim.impl=for_loop"],
     "ft.sync=streaming_diloco cannot be combined with optim.impl=for_loop"),
    (["data.micro_batch_size=auto", "plan.device_memory_gib=8"], "data.micro_batch_size=auto"),
])
def test_replica_groups_refuse_what_they_cannot_run_with(compose: Callable[..., Config], overrides: list[str],
                                                         expected: str) -> None:
    from ddptrain.app.preflight import validate_config

    cfg = compose("ft.replica_groups=2", *overrides)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg, 2)


def test_without_replica_groups_the_same_keys_pass(compose: Callable[..., Config]) -> None:
    from ddptrain.app.preflight import validate_config

    assert validate_config(compose("parallel.engine=bucketed", "ft.sync=diloco", "optim.impl=foreach"), 2) is not None
    assert validate_config(compose("ft.replica_groups=2", "ft.sync=diloco"), 2) is not None  # fused (auto): fine


def test_a_group_that_found_no_quorum_is_named_by_the_launchers_line(tmp_path: Path) -> None:
    from ddptrain.ft.supervise import quorum_lost

    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, {"event": "step", "step": 1, "quorum": 2,
                                                              "committed": True})
    assert quorum_lost(tmp_path, 2) is None
    _events(tmp_path, 1, {"event": "attempt", "attempt": 0}, {"event": "quorum_lost", "step": 7})
    line = quorum_lost(tmp_path, 2)
    assert line is not None and line.startswith("replica group 1 found no quorum of ft.min_replicas groups")
    assert "before step 7" in line and write_ft_json(tmp_path, 2)["quorum_lost"] == [{"replica_id": 1, "step": 7}]


def test_the_launchers_watch_parses_only_the_lines_written_since_its_last_poll(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher polls the groups' event files every 0.2 s for the whole run: each poll parses only what was
    written since the last (the whole files each time cost 10 ms of CPU per poll per 1,000 steps of 3 groups), a
    line still being written is read once whole, and the verdict is the whole files' (``quorum_lost``)."""
    from types import SimpleNamespace

    from ddptrain.ft import supervise

    committed = lambda s: json.dumps({"event": "step", "step": s, "quorum": 2, "committed": True}) + "\n"  # noqa: E731
    first, second = (events_path(tmp_path, g) for g in (0, 1))
    first.parent.mkdir(parents=True)
    first.write_text("".join(committed(s) for s in range(1, 101)))
    parsed: list[bytes | str] = []
    monkeypatch.setattr(supervise, "json", SimpleNamespace(loads=lambda line: parsed.append(line) or json.loads(line)))
    watch = supervise.GroupEvents(tmp_path, 2)
    assert watch.lost() is None and len(parsed) == 100
    with second.open("a") as out:  # group 1 found no quorum before step 101: its line half written
        out.write(committed(100) + '{"event": "quorum_lost", "st')
    assert watch.lost() is None and len(parsed) == 101
    with second.open("a") as out:
        out.write('ep": 101}\n')
    with first.open("a") as out:
        out.write(json.dumps({"event": "step", "step": 101, "quorum": 2, "committed": False}) + "\n")
    line = watch.lost()
    assert len(parsed) == 103 and line is not None and "replica group 1" in line and "before step 101" in line
    assert line == supervise.quorum_lost(tmp_path, 2)
    with first.open("a") as out:  # group 0 committed step 101 without group 1: it failed alone
        out.write(committed(101))
    assert watch.lost() is None and supervise.quorum_lost(tmp_path, 2) is None


def test_the_launchers_watch_reads_on_past_a_group_not_yet_started_and_a_line_cut_by_a_kill(tmp_path: Path) -> None:
    """Each poll reads every group's file on: a group whose rank 0 has not written its file yet is skipped, not the
    end of the poll (the groups after it are read), and a line cut short by a kill is one bad line: the restarted
    worker's lines after it, read in the same poll, still count."""
    from ddptrain.ft import supervise

    line = lambda record: json.dumps(record) + "\n"  # noqa: E731
    late = tmp_path / "late"  # group 0 not started yet; group 1 already found no quorum
    events_path(late, 1).parent.mkdir(parents=True)
    events_path(late, 1).write_text(line({"event": "attempt", "attempt": 0})
                                    + line({"event": "quorum_lost", "step": 3}))
    found = supervise.GroupEvents(late, 2).lost()
    assert found is not None and "replica group 1" in found and "before step 3" in found, \
        f"group 1's quorum loss not seen while group 0's file is missing: {found!r}"
    killed = tmp_path / "killed"  # group 1 killed mid-line, restarted, and then found no quorum, all in one poll
    committed = line({"event": "step", "step": 6, "quorum": 2, "committed": True})
    events_path(killed, 0).parent.mkdir(parents=True)
    events_path(killed, 0).write_text(committed)
    events_path(killed, 1).write_text(committed + '{"event": "st' + line({"event": "attempt", "attempt": 1})
                                      + line({"event": "quorum_lost", "step": 7}))
    found = supervise.GroupEvents(killed, 2).lost()
    assert found is not None and "replica group 1" in found and "before step 7" in found, \
        f"the lines after a line cut by a kill were dropped: {found!r}"


def test_a_continued_run_is_judged_by_its_own_launchs_events_not_by_the_launches_before(tmp_path: Path) -> None:
    """``train.resume=auto`` after a run stopped on a quorum loss appends to the same event files. The loss that
    stopped the launch before must not stop the continued one (read from the files' start it did, at the first
    poll: no group had committed past it), and steps committed before the groups went back to their checkpoints
    must not excuse a loss of this launch (no group of this launch got past it)."""
    from ddptrain.ft import supervise

    committed = lambda s, done=True: {"event": "step", "step": s, "quorum": 2, "committed": done}  # noqa: E731
    # the launch before: both groups committed steps 1-8; group 1 found no quorum before step 9, and the run stopped
    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, *(committed(s) for s in range(1, 9)))
    _events(tmp_path, 1, {"event": "attempt", "attempt": 0}, *(committed(s) for s in range(1, 9)),
            {"event": "quorum_lost", "step": 9})
    assert supervise.quorum_lost(tmp_path, 2) is not None  # what stopped it (and ft.json keeps it)
    events = supervise.GroupEvents.of_this_launch(tmp_path, 2)
    assert events.lost() is None  # this launch has written nothing yet

    def append(group: int, *records: dict) -> None:
        with events_path(tmp_path, group).open("a") as out:  # after the line the kill cut (``_events``)
            out.write("".join(json.dumps(r) + "\n" for r in records))

    # this launch, both groups back at their step-4 checkpoints: group 0 commits 5 and is stuck at 6 with group 1,
    # which finds no quorum before step 6. Steps 6-8 were committed, but by the launch before.
    append(0, {"event": "attempt", "attempt": 0}, committed(5), committed(6, done=False))
    append(1, {"event": "attempt", "attempt": 0}, committed(5), {"event": "quorum_lost", "step": 6})
    line = events.lost()
    assert line is not None and line.startswith("replica group 1 found no quorum") and "before step 6" in line
    append(0, committed(6))  # group 0 commits step 6 of this launch without group 1: group 1 failed alone
    assert events.lost() is None


def test_a_quorum_loss_written_as_the_last_agents_end_is_read_after_them(tmp_path: Path) -> None:
    """A group that found no quorum stops on its own: its rank 0 records the loss, says its line and exits, and its
    agent with it. When the other groups had already ended, every agent can be gone before the watch's next poll:
    the watch reads the events once more after the last agent, and the run's line is the quorum loss (it was
    "replica group 0 failed (exit code 1)", or exit 0 had another group's summary been there)."""
    from ddptrain.ft import supervise

    class Ended:  # an agent that had exited before the watch began
        def __init__(self, code: int) -> None:
            self.returncode = code

        def poll(self) -> int:
            return self.returncode

    events = supervise.GroupEvents.of_this_launch(tmp_path, 2)
    _events(tmp_path, 0, {"event": "attempt", "attempt": 0},
            {"event": "step", "step": 3, "quorum": 2, "committed": True}, {"event": "quorum_lost", "step": 4})
    _events(tmp_path, 1, {"event": "attempt", "attempt": 0},
            {"event": "step", "step": 3, "quorum": 2, "committed": True})  # killed at step 3, not restarted
    line = supervise.watch([Ended(1), Ended(1)], None, events)  # type: ignore[list-item]
    assert line is not None and line.startswith("replica group 0 found no quorum") and "before step 4" in line
    fine = supervise.GroupEvents.of_this_launch(tmp_path, 2)  # both groups ended well: nothing to say
    assert supervise.watch([Ended(0), Ended(0)], None, fine) is None  # type: ignore[list-item]


def test_the_run_summary_is_a_group_summary_written_by_this_launch(tmp_path: Path) -> None:
    """``<run dir>/summary.json`` is the lowest group's summary written since the launch started, with this
    launch's ft record. A summary an earlier launch left (the run continued with more steps) is not this run's
    result: with no group finished in this launch nothing is written (the earlier launch's top-level summary
    stays as it was, not its figures under this launch's record)."""
    from ddptrain.ft.layout import group_dir
    from ddptrain.ft.supervise import finished_first, publish_summary

    started = time.time()
    for g, loss in ((0, 3.0), (1, 2.5)):
        group_dir(tmp_path, g).mkdir(parents=True)
        (group_dir(tmp_path, g) / "summary.json").write_text(json.dumps({"final_loss": loss}))
        os.utime(group_dir(tmp_path, g) / "summary.json", (started + 1, started + 1))  # at the run's end
    os.utime(group_dir(tmp_path, 0) / "summary.json", (started - 600, started - 600))  # the launch before's
    assert finished_first(tmp_path, 2, since=started)
    publish_summary(tmp_path, 2, {"quorum_lost": []}, since=started)
    published = json.loads((tmp_path / "summary.json").read_text())
    assert published["final_loss"] == 2.5 and published["ft"] == {"summary_of_group": 1, "quorum_lost": []}
    os.utime(group_dir(tmp_path, 1) / "summary.json", (started - 600, started - 600))
    (tmp_path / "summary.json").unlink()
    assert not finished_first(tmp_path, 2, since=started)
    publish_summary(tmp_path, 2, {"quorum_lost": [{"replica_id": 0, "step": 9}]}, since=started)
    assert not (tmp_path / "summary.json").exists()
    assert finished_first(tmp_path, 2, since=0.0)  # both written, by some launch


def test_a_group_that_times_out_while_another_goes_past_its_step_fails_alone_and_stops_nothing(
        tmp_path: Path) -> None:
    """One of a group's own ranks hung before the quorum, which waited for it: the others went on committing. That
    is this group's failure (its agent restarts it), not a run that can make no progress."""
    from ddptrain.ft.supervise import quorum_lost

    committed = lambda s: {"event": "step", "step": s, "quorum": 2, "committed": True}  # noqa: E731
    _events(tmp_path, 1, {"event": "attempt", "attempt": 0}, committed(6), {"event": "quorum_lost", "step": 7})
    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, committed(6), {"event": "step", "step": 7,
                                                                             "quorum": 2, "committed": False})
    assert quorum_lost(tmp_path, 2) is not None  # group 0 did not get past step 7 either: the run is stuck
    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, committed(6), committed(7))
    assert quorum_lost(tmp_path, 2) is None  # group 0 committed step 7 without it
    _events(tmp_path, 0, {"event": "attempt", "attempt": 0}, committed(6), committed(7), committed(8),
            {"event": "quorum_lost", "step": 9})
    line = quorum_lost(tmp_path, 2)  # now group 0 is stuck at 9 and no one got past it
    assert line is not None and line.startswith("replica group 0 found no quorum") and "before step 9" in line


def test_the_lighthouse_runs_its_extension_alone_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local lighthouse is torchft's server run by this interpreter through ``lighthouse_entry.py``, which loads
    the extension module alone: the wheel's ``torchft_lighthouse`` script imports the torchft package first (torch:
    1.9 CPU s, 6-8 s before the groups could start on a busy machine). Where the extension is not a file beside
    the package, the entry takes the console script's own import."""
    import subprocess

    from ddptrain.ft import lighthouse, lighthouse_entry

    command = lighthouse.command()
    assert command == [sys.executable, str(Path(lighthouse_entry.__file__))]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--min_replicas" in done.stdout, done.stderr
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('entry', sys.argv[1]); "
             "entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry); "
             "main = entry.lighthouse_main(); print(main.__name__, sorted({'torch', 'torchft'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe, command[1]], capture_output=True, text=True, timeout=60)
    assert loaded.stdout.split() == ["lighthouse_main", "[]"], loaded.stderr[-2000:]
    monkeypatch.setattr(lighthouse_entry.importlib.util, "find_spec", lambda name: None)  # no file to load alone
    import torchft._torchft

    assert lighthouse_entry.lighthouse_main() is torchft._torchft.lighthouse_main


def test_the_local_launch_starts_one_agent_per_group_and_exits_as_the_groups_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``launch_groups`` in-process, its processes stubbed: each group's agent is ``ddptrain`` with the group's
    overrides and the lighthouse's address (ours, or ``ft.lighthouse``'s), in a group folder made in a run dir
    that need not exist yet; torchft's Rust log at warn unless RUST_LOG says otherwise; Ctrl-C's handlers put
    back; exit 0 when every group finished or one finished first, the worker's own code when it said its line."""
    import signal
    from types import SimpleNamespace

    from ddptrain.app import ft_launch
    from ddptrain.app.said import SAID_DIR_ENV
    from ddptrain.ft.layout import GROUP_AGENT_ENV, group_dir

    started: list[tuple[list[str], dict[str, str]]] = []
    codes: list[int] = []
    lighthouses: list[str] = []
    writes: dict[int, dict] = {}  # group: the event its agent writes once started
    finishing: set[int] = set()  # groups whose agent writes their summary.json (they trained every step)
    agent_starts: list[float] = []
    watched: list[str | None] = []  # what the launch's watch found in the events it was given

    class Agent:
        def __init__(self, argv: list[str], env: dict[str, str], start_new_session: bool) -> None:
            started.append((argv, env))
            agent_starts.append(time.time())
            # the groups start with no claim of an earlier launch's line (emptied at the start, not at the end: a
            # launcher killed before its end would leave them, and the next launch's line would go unsaid)
            assert not any(Path(env[SAID_DIR_ENV]).glob("*"))
            self.returncode = codes[len(started) - 1]
            if (event := writes.get(len(started) - 1)) is not None:
                with events_path(run_dir, len(started) - 1).open("a") as out:
                    out.write(json.dumps(event) + "\n")
            if len(started) - 1 in finishing:
                summary = group_dir(run_dir, len(started) - 1) / "summary.json"
                summary.write_text("{}")
                os.utime(summary, (time.time() + 1, time.time() + 1))  # at the group's end, not as it starts

        def poll(self) -> int:
            return self.returncode

    class OwnLighthouse:
        address = "http://localhost:29511"

        def __init__(self, run_dir: Path, min_replicas: int) -> None:
            lighthouses.append(f"started for {min_replicas}")

        def start(self) -> OwnLighthouse:
            return self

        def stop(self) -> None:
            lighthouses.append("stopped")

    run_dir = tmp_path / "fresh" / "run"  # not made yet: the launch makes the group folders
    monkeypatch.setattr(ft_launch, "validate_config", lambda typed, world: None)
    checked: list[int] = []  # the replica groups whose folders the launcher checked before starting anything
    monkeypatch.setattr(ft_launch, "ready_run_dir",
                        lambda run, world, shape, doing, replica_groups: checked.append(replica_groups) or run_dir)
    monkeypatch.setattr(ft_launch, "Lighthouse", OwnLighthouse)
    monkeypatch.setattr(ft_launch.subprocess, "Popen", Agent)
    monkeypatch.setattr(ft_launch, "watch", lambda agents, lighthouse, events: watched.append(events.lost()))
    monkeypatch.setattr(ft_launch, "write_ft_json", lambda run_dir, groups: {})
    published: list[float] = []  # the launch start each publish_summary was given
    monkeypatch.setattr(ft_launch, "publish_summary", lambda run_dir, groups, record, since: published.append(since))
    monkeypatch.delenv("RUST_LOG", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def launched(lighthouse: str | None, *ended: int) -> int:
        started.clear()
        codes[:] = ended
        typed = SimpleNamespace(ft=SimpleNamespace(replica_groups=len(ended), min_replicas=1, lighthouse=lighthouse,
                                                   group_restarts=3), launch=SimpleNamespace(nproc_per_node=2))
        return ft_launch.launch_groups(SimpleNamespace(typed=typed), ["model=llama_tiny"])

    before = time.time()
    assert launched("lighthouse.example:29510", 0, 0) == 0 and lighthouses == [] and checked == [2]
    assert before <= published[-1] <= agent_starts[0]  # what the groups write from their start on is this launch's
    for g, (argv, env) in enumerate(started):
        assert argv == [sys.executable, "-m", "ddptrain",
                        *group_argv(["model=llama_tiny"], run_dir, g, "lighthouse.example:29510")]
        assert env[GROUP_AGENT_ENV] == "1" and env["RUST_LOG"] == "warn" and group_dir(run_dir, g).is_dir()
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    said = run_dir / "ft" / "said"  # where the groups' workers claim the lines they say (app/said.py)
    assert all(env[SAID_DIR_ENV] == str(said) for _, env in started)
    claimed = said / "an earlier launch's line"
    claimed.parent.mkdir(parents=True, exist_ok=True)
    claimed.touch()
    monkeypatch.setenv("RUST_LOG", "debug")
    assert launched(None, 0, 1) == 1  # no group finished: group 1's failure (it said no line of its own)
    assert not claimed.exists()  # each launch's groups say their lines afresh (the agents saw no claim)
    assert lighthouses == ["started for 1", "stopped"] and started[0][1]["RUST_LOG"] == "debug"
    assert started[1][0][-1] == "ft.lighthouse=http://localhost:29511"
    assert launched(None, 0, 4) == 4 and launched(None, 1, 4) == 1  # the first failed group's code, if it said it
    earlier = group_dir(run_dir, 0) / "summary.json"  # group 0 trained every step of the launch before
    earlier.write_text("{}")
    os.utime(earlier, (time.time() - 3600, time.time() - 3600))
    assert launched(None, 0, 1) == 1  # that says nothing of this launch, whose group 1 failed
    finishing.add(0)
    capsys.readouterr()
    assert launched(None, 0, 143) == 0  # group 0 trained every step in this launch; group 1 was stopped late
    assert capsys.readouterr().err == ""  # (watch() named it as it stopped it)
    assert launched(None, 0, 1) == 0  # group 1 failed on its own, restarts spent (its agent said nothing)
    assert capsys.readouterr().err.splitlines() == [
        "ddptrain: note: replica group 1 failed (exit code 1) after ft.group_restarts=3 restarts; the other groups "
        "trained every step"]
    finishing.clear()
    assert watched == [None] * 7
    # continued in the same run dir: the files hold the launch before's loss (group 0, step 9); this launch's
    # group 1 finds no quorum before step 2 once started. The watch is given this launch's lines, all of them.
    _events(run_dir, 0, {"event": "quorum_lost", "step": 9})
    writes[1] = {"event": "quorum_lost", "step": 2}
    launched(None, 0, 1)
    assert watched[-1] is not None and watched[-1].startswith("replica group 1 ") and "before step 2" in watched[-1]


def test_a_line_every_replica_group_says_alike_is_said_once_and_lines_that_differ_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each group's rank 0 says its last line through ``say_once``; with the groups' launcher's folder set, a line
    another group already said is not said again, a line of its own is; outside a groups' launch every line is
    said, and so is one whose claim cannot be written."""
    from ddptrain.app import cli
    from ddptrain.app.said import SAID_DIR_ENV, first_to_say, fresh_said_dir

    for name in (SAID_DIR_ENV, "WORLD_SIZE", "RANK"):  # each group's rank 0
        monkeypatch.delenv(name, raising=False)
    refusal = "ddptrain: error: data.paths: /d/pc.jsonl: line 7: 'completion' is a list, expected a string"
    assert first_to_say(refusal) and first_to_say(refusal)
    said = tmp_path / "run" / "ft" / "said"
    monkeypatch.setenv(SAID_DIR_ENV, str(said))
    own = "ddptrain: replica group 1: no quorum of ft.min_replicas=2 groups within ft.quorum_timeout_s=60; stopping"
    for line in (refusal, refusal, own, refusal):  # group 0's, group 1's, then lines of one group each
        cli.say_once(line)
    assert capsys.readouterr().err.splitlines() == [refusal, own]
    assert fresh_said_dir(said) == said and not said.exists()  # the next launch
    assert first_to_say(refusal) and not first_to_say(refusal)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(SAID_DIR_ENV, str(blocked / "said"))
    assert first_to_say(refusal) and first_to_say(refusal)
    # inside a group of 2 ranks: rank 1 claims only after its grace, by when the agent stopped it if rank 0 ended
    # alike. Claimed before its grace, the line was claimed by a rank that never said it, and rank 0 was silent.
    monkeypatch.setenv(SAID_DIR_ENV, str(fresh_said_dir(said)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)

    def stopped_by_the_agent(seconds: float) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(cli.time, "sleep", stopped_by_the_agent)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        cli.say_once(refusal)
    monkeypatch.setenv("RANK", "0")
    cli.say_once(refusal)
    assert capsys.readouterr().err.splitlines() == [refusal]


def test_the_local_launch_watches_the_events_of_every_group_whatever_its_workers_per_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's watch reads one event file per replica group (``ft.replica_groups``), not one per worker of a
    group (``launch.nproc_per_node``): with 3 groups of 1 worker, a quorum loss of group 2 stops the run. Read
    for 1 "group", the loss went unseen: no group's loss but group 0's could stop the run with its line."""
    from types import SimpleNamespace

    from ddptrain.app import ft_launch

    run_dir = tmp_path / "run"
    watched: list[tuple[int, str | None]] = []  # (event files watched, what the watch found)

    class Agent:
        def __init__(self, argv: list[str], env: dict[str, str], start_new_session: bool) -> None:
            self.returncode = 1
            if argv[-2] == "ft.replica_id=2":  # group 2 finds no quorum before its step 5 once started
                _events(run_dir, 2, {"event": "attempt", "attempt": 0}, {"event": "quorum_lost", "step": 5})

        def poll(self) -> int:
            return self.returncode

    monkeypatch.setattr(ft_launch, "validate_config", lambda typed, world: None)
    monkeypatch.setattr(ft_launch, "ready_run_dir", lambda run, world, shape, doing, replica_groups: run_dir)
    monkeypatch.setattr(ft_launch.subprocess, "Popen", Agent)
    monkeypatch.setattr(ft_launch, "watch",
                        lambda agents, lighthouse, events: watched.append((len(events.paths), events.lost())))
    monkeypatch.setattr(ft_launch, "write_ft_json", lambda run_dir, groups: {})
    monkeypatch.setattr(ft_launch, "publish_summary", lambda run_dir, groups, record, since: None)
    typed = SimpleNamespace(ft=SimpleNamespace(replica_groups=3, min_replicas=2, lighthouse="lighthouse.example:1",
                                               group_restarts=0), launch=SimpleNamespace(nproc_per_node=1))
    ft_launch.launch_groups(SimpleNamespace(typed=typed), ["model=llama_tiny"])
    assert len(watched) == 1 and watched[0][0] == 3, watched
    line = watched[0][1]
    assert line is not None and line.startswith("replica group 2 ") and "before step 5" in line
