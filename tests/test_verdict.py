"""The launcher's verdict from the ranks' evidence files: late, mismatched (kind or size), dead, or nothing to say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddptrain.diagnose.evidence import HANG_DIR
from ddptrain.diagnose.verdict import Failure, verdict
from ddptrain.diagnose.whereabouts import Whereabouts, read_whereabouts


def _record(folder: Path, rank: int, reason: str, step: int, phase: str, collectives: list[tuple[int, str, int]],
            where: str | None = None) -> None:
    entries = [{"seq": s, "op": op, "sizes": [], "bytes": b} for s, op, b in collectives]
    record: dict[str, Any] = {"rank": rank, "host": "vm", "pid": 1, "time": 0.0, "reason": reason, "error": None,
                              "step": step, "phase": phase, "where": where, "collectives": entries}
    (folder / f"rank{rank}.json").write_text(json.dumps(record))


def _folder(tmp_path: Path) -> Path:
    (tmp_path / HANG_DIR).mkdir()
    return tmp_path / HANG_DIR


def test_the_rank_that_never_entered_the_collective_is_the_late_one(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _record(folder, 0, "collective timed out", 4, "loss mean", [(40, "all_reduce", 1024), (41, "all_reduce", 8)])
    _record(folder, 2, "collective timed out", 4, "loss mean", [(41, "all_reduce", 8)])
    _record(folder, 1, "SIGTERM from the launcher", 4, "data", [(40, "all_reduce", 1024)], "ddptrain/data/loader.py:88")
    assert verdict(tmp_path, [Failure(0, 1, None)], 3, 15, "vm") == (
        "rank 1 (host vm) hung at step 4 in data loading (ddptrain/data/loader.py:88); ranks 0, 2 waited in "
        "all_reduce #41 (the loss mean of a logging step of step 4, 8 bytes) for 15 s (dist.timeout_s)")


def test_the_same_collective_with_different_sizes_is_a_mismatch_not_a_late_rank(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _record(folder, 0, "collective timed out", 3, "backward", [(12, "all_reduce", 4096)])
    _record(folder, 1, "collective timed out", 3, "backward", [(12, "all_reduce", 2048)])
    line = verdict(tmp_path, [Failure(0, 1, None)], 2, 15, "vm")
    assert line == ("mismatched collectives: as collective #12 the ranks called different ones: rank 0 all_reduce of "
                    "4.0 KB at step 3 in backward; rank 1 all_reduce of 2.0 KB at step 3 in backward")


def test_a_rank_killed_by_a_signal_is_named_with_it_and_where_it_was(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    where = Whereabouts()
    where.open(folder / "rank1.where")
    where.at("forward", 7)
    _record(folder, 0, "collective timed out", 7, "forward", [(30, "all_reduce", 8)])
    line = verdict(tmp_path, [Failure(1, -9, "SIGKILL"), Failure(0, 1, None)], 2, 15, "vm")
    assert line == ("rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 7 in forward; rank 0 "
                    "waited in all_reduce #30 (forward of step 7, 8 bytes) for 15 s (dist.timeout_s)")


def test_a_rank_killed_after_it_recorded_its_own_timeout_is_not_the_cause(tmp_path: Path) -> None:
    # Both ranks timed out in mismatched collectives; rank 1 was still leaving when rank 0 exited, and the agent
    # SIGKILLed it after launch.stop_grace_s: the mismatch is the cause, not that kill.
    folder = _folder(tmp_path)
    _record(folder, 0, "collective timed out", 4, "forward", [(38, "all_reduce", 1024), (39, "broadcast", 64)])
    _record(folder, 1, "collective timed out", 3, "after the update", [(38, "all_reduce", 1024),
                                                                     (39, "all_reduce", 12)])
    line = verdict(tmp_path, [Failure(0, 1, None), Failure(1, -9, "SIGKILL")], 2, 5, "vm")
    assert line is not None and line.startswith("mismatched collectives: as collective #39 the ranks called"), line


def test_a_rank_that_aborted_inside_a_collective_is_a_mismatch(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "rank1.stacks").write_text(
        "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 2900 in all_reduce\n'
        '  File "/x/ddptrain/step/compute.py", line 46 in global_mean\n'
        '  File "/x/ddptrain/train/loop.py", line 120 in train\n\nThread 0x2:\n')
    line = verdict(tmp_path, [Failure(1, -6, "SIGABRT")], 2, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host vm) aborted (SIGABRT) inside a collective at step 0 "
                                                "(ddptrain/step/compute.py:46): its collective does not match")


def test_evidence_older_than_the_launch_is_an_earlier_launchs_and_names_nothing(tmp_path: Path) -> None:
    """A run continued in its run dir keeps an earlier launch's hang files until each rank's start replaces its
    own. Each kind written before ``since`` is left out: a record (its own time), a rank's whereabouts, its stacks
    and an NCCL dump (their files' times). The same files written after ``since`` are read."""
    import os
    import time

    folder = _folder(tmp_path)
    now = time.time()
    _record(folder, 0, "collective timed out", 4, "loss mean", [(41, "all_reduce", 8)])  # time 0.0: long before
    assert verdict(tmp_path, [Failure(0, 1, None)], 2, 15, "vm") is not None  # read without ``since``
    assert verdict(tmp_path, [Failure(0, 1, None)], 2, 15, "vm", since=now) is None
    (folder / "rank0.json").unlink()
    where = Whereabouts()
    where.open(folder / "rank1.where")
    where.at("forward", 7)
    where.close()
    (folder / "rank1.stacks").write_text(
        "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 2900 in all_reduce\n'
        '  File "/x/ddptrain/step/compute.py", line 46 in global_mean\n\nThread 0x2:\n')
    _nccl_dump(folder, 0, [(30, "all_reduce", 8, "scheduled")])  # rank 0 waiting in #30
    for name in ("rank1.where", "rank1.stacks", "nccl_trace_rank_0"):  # written a while after the launch started
        os.utime(folder / name, (now + 1, now + 1))  # (a coarse file clock could date them just before ``now``)
    killed, aborted = [Failure(1, -9, "SIGKILL"), Failure(0, 1, None)], [Failure(1, -6, "SIGABRT")]
    fresh = {"killed": verdict(tmp_path, killed, 2, 15, "vm", since=now),
             "aborted": verdict(tmp_path, aborted, 2, 15, "vm", since=now)}
    assert fresh["killed"] == ("rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 7 in forward "
                               "(ddptrain/step/compute.py:46); rank 0 waited in all_reduce #30 (start-up of step 0, "
                               "8 bytes) for 15 s (dist.timeout_s)")
    assert fresh["aborted"] is not None and "aborted (SIGABRT) inside a collective" in fresh["aborted"]
    for name in ("rank1.where", "rank1.stacks", "nccl_trace_rank_0"):
        os.utime(folder / name, (now - 600, now - 600))
    assert verdict(tmp_path, killed, 2, 15, "vm", since=now) == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 0 in start-up")
    assert verdict(tmp_path, aborted, 2, 15, "vm", since=now) == (
        "rank 1 (host vm) died of SIGABRT at step 0 in start-up")


def test_a_dump_where_the_user_pointed_nccl_is_judged_by_that_files_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's ``TORCH_FR_DUMP_TEMP_FILE`` puts NCCL's dumps outside ``hang/``: whether a dump is this launch's is
    read from the dump the verdict reads (there), not from a ``hang/nccl_trace_rank_{r}`` that does not exist. A
    fresh dump there names its rank as a waiter; the same dump from before ``since`` names nothing."""
    import os
    import time

    from tests.helpers.nccl_twin import nccl_dump

    _folder(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "elsewhere" / "trace_"))
    now = time.time()
    (tmp_path / "elsewhere" / "trace_0").write_bytes(nccl_dump([(30, "all_reduce", 8, "scheduled")]))
    os.utime(tmp_path / "elsewhere" / "trace_0", (now + 1, now + 1))  # written after the launch started
    failures = [Failure(1, -9, "SIGKILL"), Failure(0, -6, "SIGABRT")]  # rank 0: NCCL's watchdog, waiting for 1
    assert verdict(tmp_path, failures, 2, 15, "vm", since=now) == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 0 in start-up; rank 0 waited in "
        "all_reduce #30 (start-up of step 0, 8 bytes) for 15 s (dist.timeout_s)")
    os.utime(tmp_path / "elsewhere" / "trace_0", (now - 600, now - 600))  # an earlier launch's
    assert verdict(tmp_path, failures, 2, 15, "vm", since=now) == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 0 in start-up")


def test_without_evidence_of_a_hang_or_a_death_there_is_no_verdict(tmp_path: Path) -> None:
    _folder(tmp_path)
    assert verdict(tmp_path, [Failure(0, 2, None)], 2, 15, "vm") is None  # a worker's own one-line error


def test_whereabouts_survive_in_the_file_and_read_back() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        where = Whereabouts()
        where.open(Path(tmp) / "w")
        where.at("backward", 12)
        where.at("optimizer")
        assert read_whereabouts(Path(tmp) / "w") == (12, "optimizer")


def _collectives(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from ddptrain.diagnose.evidence import flight_record

    dist.all_reduce(torch.zeros((), dtype=torch.float64))
    dist.barrier()
    return flight_record()["collectives"]


def test_the_flight_recorder_keeps_torchs_whole_ring_by_default_and_zero_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's ring is one per process, every group's collectives in it (default 2000 entries): the default never
    shrinks it, and dist.flight_recorder=0 is a real off (torch records nothing), not torch's own default."""
    import os

    from ddptrain.config.schema import DistConfig
    from ddptrain.diagnose.evidence import enable_flight_recorder
    from tests.helpers.dist import run_distributed

    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    enable_flight_recorder(DistConfig().flight_recorder)  # what every worker does before its process group exists
    assert int(os.environ.get("TORCH_FR_BUFFER_SIZE", 2000)) >= 2000  # unset: torch 2.13's default, 2000 entries
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    for rank_record in run_distributed(_collectives, 2):
        (reduce, barrier) = rank_record[-2:]
        assert (reduce["op"], reduce["bytes"], barrier["op"]) == ("all_reduce", 8, "barrier")
        assert barrier["seq"] == reduce["seq"] + 1
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "5000")  # the user's own ring, where the key says nothing
    enable_flight_recorder(DistConfig().flight_recorder)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "5000"
    enable_flight_recorder(0)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert run_distributed(_collectives, 2) == [[], []]


# --- NCCL: the watchdog aborts a waiting rank (SIGABRT, no Python exception, no record of its own); its flight
# recorder dump in <run dir>/hang/ says what it waited in. Dumps are written in torch's format (tests/helpers).

def _nccl_dump(folder: Path, rank: int, collectives: list[tuple[int, str, int, str]]) -> None:
    from tests.helpers.nccl_twin import nccl_dump

    (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(collectives))


def _run_ahead_verdict(tmp_path: Path, ring_of_rank_1: int = 2000) -> str | None:
    """Rank 1's stream stuck before its #8 (broadcasts #8 and #9 complete on the root without it) while its host
    enqueued on to #12; rank 0 waits in #10. Both aborted by the watchdog; the verdict read from their dumps."""
    from tests.helpers.nccl_twin import nccl_dump

    folder = _folder(tmp_path)
    ops = {8: "broadcast", 9: "broadcast"}
    for rank, completed, enqueued, ring in ((0, 9, 11, 2000), (1, 7, 12, ring_of_rank_1)):
        collectives = [(s, ops.get(s, "all_reduce"), 64, "completed" if s <= completed else "scheduled")
                       for s in range(1, enqueued + 1)]
        (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(collectives, ring=ring))
        _aborted_by_the_watchdog(folder, rank)
    _at(folder, 0, "check", 2)
    _at(folder, 1, "forward", 3)
    return verdict(tmp_path, [Failure(0, -6, "SIGABRT"), Failure(1, -6, "SIGABRT")], 2, 15, "vm")


def _aborted_by_the_watchdog(folder: Path, rank: int) -> None:
    """What faulthandler writes when NCCL's watchdog thread calls abort(): no "Current thread" (the aborting
    thread is not Python's), the main thread blocked wherever the host last synchronized."""
    (folder / f"rank{rank}.stacks").write_text(
        "Fatal Python error: Aborted\n\nThread 0x2 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 2900 in all_reduce\n'
        '  File "/x/ddptrain/step/compute.py", line 46 in global_mean\n'
        '  File "/x/ddptrain/train/loop.py", line 120 in train\n\n')


def test_on_nccl_a_rank_aborted_by_the_watchdog_while_waiting_is_a_waiter_not_the_cause(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    where = Whereabouts()
    where.open(folder / "rank0.where")
    where.at("loss mean", 3)
    _aborted_by_the_watchdog(folder, 0)
    _nccl_dump(folder, 0, [(40, "all_reduce", 1024, "completed"), (41, "all_reduce", 8, "started")])
    _record(folder, 1, "SIGTERM from the launcher", 3, "data", [], "ddptrain/train/loop.py:55")
    _nccl_dump(folder, 1, [(40, "all_reduce", 1024, "completed")])
    failures = [Failure(0, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")]
    assert verdict(tmp_path, failures, 2, 15, "vm") == (
        "rank 1 (host vm) hung at step 3 in data loading (ddptrain/train/loop.py:55); rank 0 waited in all_reduce "
        "#41 (the loss mean of a logging step of step 3, 8 bytes) for 15 s (dist.timeout_s)")


def test_on_nccl_the_collective_waited_in_is_the_first_unfinished_one_not_the_last_enqueued(tmp_path: Path) -> None:
    # NCCL returns at enqueue: the host of a waiting rank runs ahead and enqueues more before it blocks
    folder = _folder(tmp_path)
    for rank in (0, 2):
        _nccl_dump(folder, rank, [(40, "all_reduce", 1024, "completed"), (41, "broadcast", 64, "started"),
                                  (42, "all_reduce", 8, "scheduled")])
    _record(folder, 1, "SIGTERM from the launcher", 3, "forward", [(40, "all_reduce", 1024)])
    failures = [Failure(0, -6, "SIGABRT"), Failure(2, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")]
    line = verdict(tmp_path, failures, 3, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host vm) hung at step 3 in forward;"), line
    assert "ranks 0, 2 waited in broadcast #41" in line, line


def test_on_nccl_watchdog_aborts_in_different_collectives_of_one_number_are_a_mismatch(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    for rank, step, phase in ((0, 4, "forward"), (1, 3, "after the update")):
        where = Whereabouts()
        where.open(folder / f"rank{rank}.where")
        where.at(phase, step)
    _nccl_dump(folder, 0, [(38, "all_reduce", 1024, "completed"), (39, "broadcast", 64, "started")])
    _nccl_dump(folder, 1, [(38, "all_reduce", 1024, "completed"), (39, "all_reduce", 12, "started")])
    line = verdict(tmp_path, [Failure(1, -6, "SIGABRT"), Failure(0, -6, "SIGABRT")], 2, 15, "vm")
    assert line is not None and line.startswith("mismatched collectives: as collective #39 the ranks called "
                                                "different ones: rank 0 broadcast of 64 bytes"), line


def test_on_nccl_a_rank_that_died_before_any_dump_is_the_cause_and_the_aborted_one_its_waiter(tmp_path: Path) -> None:
    # rank 1 crashed (a device-side assert aborts too) before any timeout: no dump of its own; rank 0 then timed
    # out waiting for it and was aborted by the watchdog
    folder = _folder(tmp_path)
    where = Whereabouts()
    where.open(folder / "rank1.where")
    where.at("backward", 5)
    _nccl_dump(folder, 0, [(50, "all_reduce", 4096, "started")])
    _aborted_by_the_watchdog(folder, 0)
    line = verdict(tmp_path, [Failure(1, -6, "SIGABRT"), Failure(0, -6, "SIGABRT")], 2, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host vm) died of SIGABRT at step 5 in backward; rank 0 "
                                                "waited in all_reduce #50"), line


def test_a_record_takes_its_collectives_from_the_nccl_trace_when_it_holds_the_trainings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ddptrain.diagnose.evidence import flight_record
    from tests.helpers.nccl_twin import nccl_dump

    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *_: nccl_dump([(7, "broadcast", 64, "scheduled")]),
                        raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *_: nccl_dump([(40, "all_reduce", 8, "completed"),
                                                                        (41, "all_reduce_barrier", 4, "started")]),
                        raising=False)
    assert [(c["seq"], c["op"], c["completed"]) for c in flight_record()["collectives"]] == [
        (40, "all_reduce", True), (41, "barrier", False)]
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *_: nccl_dump([]), raising=False)  # a CUDA build on gloo
    assert [(c["seq"], c["op"]) for c in flight_record()["collectives"]] == [(7, "broadcast")]
    assert "completed" not in flight_record()["collectives"][0]  # gloo's states stay "scheduled": they say nothing


def test_nccls_dump_is_pointed_into_the_run_dir_unless_the_user_pointed_it_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ddptrain.diagnose.evidence import nccl_dump_prefix, point_nccl_dump

    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / HANG_DIR).mkdir()
    (tmp_path / HANG_DIR / "nccl_trace_rank_1").write_bytes(b"a previous attempt's")
    point_nccl_dump(tmp_path / HANG_DIR, 1)  # what each worker's evidence does once the run dir is known
    expected = str(tmp_path / HANG_DIR / "nccl_trace_rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == expected
    assert not (tmp_path / HANG_DIR / "nccl_trace_rank_1").exists()
    # a second run in this process (tests, sweeps' in-process jobs) points it into its own run dir, not the first's
    (tmp_path / "second" / HANG_DIR).mkdir(parents=True)
    point_nccl_dump(tmp_path / "second" / HANG_DIR, 1)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "second" / HANG_DIR / "nccl_trace_rank_")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/trace_")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    assert nccl_dump_prefix(tmp_path / HANG_DIR) == "/elsewhere/trace_"


def _dump_to_file(rank: int, world_size: int, folder: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from ddptrain.diagnose.evidence import read_nccl_dump

    dist.all_reduce(torch.zeros(3))
    dist.barrier()
    path = Path(folder) / f"nccl_trace_rank_{rank}"
    path.write_bytes(torch._C._distributed_c10d._dump_fr_trace())  # the writer NCCL's dump uses too
    return read_nccl_dump(path)


def test_torchs_own_flight_recorder_dump_reads_without_running_code_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.dist import run_distributed

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "16")
    for read in run_distributed(_dump_to_file, 2, str(tmp_path)):
        assert read is not None and [c["op"] for c in read["collectives"][-2:]] == ["all_reduce", "barrier"], read
    (tmp_path / "evil").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would call os.system
    from ddptrain.diagnose.evidence import read_nccl_dump

    assert read_nccl_dump(tmp_path / "evil") is None


# ---- waiters in different collective numbers (issue 33) ---------------------------------------------------------

def test_of_waiters_in_different_collectives_the_one_below_the_highest_is_the_late_rank(tmp_path: Path) -> None:
    """Every rank timed out, in different collective numbers: ranks 0 and 2 reached #41 (the loss mean), rank 1
    is still in #40 (its backward's gradient sync). Rank 1 is the late one, and only ranks 0 and 2 waited in #41."""
    folder = _folder(tmp_path)
    _record(folder, 0, "collective timed out", 4, "loss mean", [(40, "all_reduce", 4096), (41, "all_reduce", 8)])
    _record(folder, 1, "collective timed out", 4, "backward", [(39, "all_reduce", 8), (40, "all_reduce", 4096)])
    _record(folder, 2, "collective timed out", 4, "loss mean", [(40, "all_reduce", 4096), (41, "all_reduce", 8)])
    failures = [Failure(0, 1, None), Failure(1, 1, None), Failure(2, 1, None)]
    assert verdict(tmp_path, failures, 3, 15, "vm") == (
        "rank 1 (host vm) hung at step 4 in backward; ranks 0, 2 waited in all_reduce #41 (the loss mean of a "
        "logging step of step 4, 8 bytes) for 15 s (dist.timeout_s)")


# ---- NCCL run-ahead, the whole ring, every process group (issue 40) ----------------------------------------------

BUCKET = 2**20  # bytes of one gradient bucket's all-reduce
BUCKETS = 600  # bucket all-reduces per step


def _run_ahead(last_enqueued: int, completed: int) -> list[tuple[int, str, int, str]]:
    """A rank's default-group collectives: BUCKETS per step; finished up to ``completed``, enqueued to
    ``last_enqueued`` (NCCL returns at enqueue: the host queued the rest without waiting)."""
    return [(s, "all_reduce", BUCKET, "completed" if s <= completed else "scheduled")
            for s in range(1, last_enqueued + 1)]


def _at(folder: Path, rank: int, phase: str, step: int) -> None:
    where = Whereabouts()
    where.open(folder / f"rank{rank}.where")
    where.at(phase, step)


def test_on_nccl_a_waiter_whose_host_ran_ahead_is_read_to_its_first_unfinished_collective(tmp_path: Path) -> None:
    """4 ranks, 600 bucket all-reduces per step, rank 3 hung in data loading at step 5 (4 steps done: #2400);
    the other ranks' hosts enqueued on to #3500, #3400 and #3000 before their watchdogs fired. Each dump holds
    torch's default ring of 2000 entries; the collective they wait in is #2401, far from their last."""
    from tests.helpers.nccl_twin import nccl_dump

    folder = _folder(tmp_path)
    ranks = {"0": ("default_pg", [0, 1, 2, 3])}
    for rank, enqueued in ((0, 3500), (1, 3400), (2, 3000)):
        (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(_run_ahead(enqueued, 2400), groups=ranks))
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, "backward", 1 + enqueued // BUCKETS)
    (folder / "nccl_trace_rank_3").write_bytes(nccl_dump(_run_ahead(2400, 2400), groups=ranks))
    _at(folder, 3, "data", 5)
    _record(folder, 3, "SIGTERM from the launcher", 5, "data", [], "ddptrain/train/observer.py:60")
    failures = [Failure(0, -6, "SIGABRT"), Failure(1, -6, "SIGABRT"), Failure(2, -6, "SIGABRT"),
                Failure(3, -15, "SIGTERM")]
    assert verdict(tmp_path, failures, 4, 300, "vm") == (
        "rank 3 (host vm) hung at step 5 in data loading (ddptrain/train/observer.py:60); ranks 0, 1, 2 waited in "
        "all_reduce #2401 (1.0 MB, the host ran ahead of it) for 300 s (dist.timeout_s)")


def test_on_nccl_a_stuck_collective_that_fell_out_of_a_shrunk_ring_is_read_from_pg_status(tmp_path: Path) -> None:
    """dist.flight_recorder=64 asked explicitly: the ring holds #3437-#3500, the stuck #2401 is gone from it; the
    dump's pg_status (last completed: #2400) still says which collective it is."""
    from tests.helpers.nccl_twin import nccl_dump

    folder = _folder(tmp_path)
    (folder / "nccl_trace_rank_0").write_bytes(nccl_dump(_run_ahead(3500, 2400), ring=64))
    _aborted_by_the_watchdog(folder, 0)
    _at(folder, 0, "backward", 6)
    _record(folder, 1, "SIGTERM from the launcher", 5, "data", [(2400, "all_reduce", BUCKET)])
    line = verdict(tmp_path, [Failure(0, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")], 2, 300, "vm")
    assert line == ("rank 1 (host vm) hung at step 5 in data loading; rank 0 waited in collective #2401 (gone from "
                    "the flight recorder's ring, the host ran ahead of it) for 300 s (dist.timeout_s)")


HSDP_GROUPS = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("mesh_replicate", [0, 2]), "2": ("mesh_replicate", [1, 3]),
               "3": ("mesh_shard", [0, 1]), "4": ("mesh_shard", [2, 3])}


def _hsdp_dump(folder: Path, rank: int, collectives: list[tuple[str, int, str, int, str]]) -> None:
    from tests.helpers.nccl_twin import nccl_dump

    mine = {name: HSDP_GROUPS[name] for name in ("0", _replicate(rank), _shard(rank))}
    (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(_renumber(collectives), groups=mine))


def _replicate(rank: int) -> str:
    return "1" if rank in (0, 2) else "2"


def _shard(rank: int) -> str:
    return "3" if rank < 2 else "4"


def _hsdp_step(rank: int, states: tuple[str, str, str, str]) -> list[tuple[str, str, int, str]]:
    """One HSDP step of one FSDP2 unit, each collective with its state: two all-gathers (forward, backward) and a
    reduce-scatter on the shard group, the replicas' all-reduce, the loss mean on the default group."""
    shard, replicate = _shard(rank), _replicate(rank)
    gathers, scatter, reduce, mean = states
    return [(shard, "_allgather_base", 4096, gathers), (shard, "_allgather_base", 4096, gathers),
            (shard, "_reduce_scatter_base", 8192, scatter), (replicate, "all_reduce", 4096, reduce),
            ("0", "all_reduce", 4, mean)]


def _renumber(collectives: list[tuple[str, str, int, str]]) -> list[tuple[str, int, str, int, str]]:
    """Sequence numbers counted per group, in enqueue order, as torch counts them."""
    seen: dict[str, int] = {}
    out = []
    for group, op, nbytes, state in collectives:
        seen[group] = seen.get(group, 0) + 1
        out.append((group, seen[group], op, nbytes, state))
    return out


def test_an_hsdp_hang_is_named_from_the_mesh_groups_collectives(tmp_path: Path) -> None:
    """HSDP on a 2x2 mesh (shard groups [0, 1], [2, 3]; replica groups [0, 2], [1, 3]): rank 1 hung in forward at
    step 3, before its FSDP2 all-gather. Rank 0 waits in that all-gather on its shard group; ranks 2 and 3 got
    through forward and backward on theirs and wait in the replicas' all-reduce, their hosts past it. The default
    group's collectives all completed: reading only those, there is no verdict."""
    folder = _folder(tmp_path)
    done = ("completed",) * 4
    for rank in range(4):
        steps = _hsdp_step(rank, done) + _hsdp_step(rank, done)
        if rank == 0:  # step 3: its forward's all-gather waits for rank 1; the host enqueued the next one
            steps += [(_shard(0), "_allgather_base", 4096, "scheduled")] * 2
        if rank in (2, 3):  # step 3 on their own shard group, then the replicas' all-reduce and on
            steps += _hsdp_step(rank, ("completed", "completed", "scheduled", "scheduled"))
        _hsdp_dump(folder, rank, steps)
    for rank, phase in ((0, "forward"), (2, "check"), (3, "check")):
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, phase, 3)
    _record(folder, 1, "SIGTERM from the launcher", 3, "forward", [], "ddptrain/train/observer.py:61")
    failures = [Failure(0, -6, "SIGABRT"), Failure(2, -6, "SIGABRT"), Failure(3, -6, "SIGABRT"),
                Failure(1, -15, "SIGTERM")]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "rank 1 (host vm) hung at step 3 in forward (ddptrain/train/observer.py:61); rank 0 waited in "
        "all_gather_into_tensor #7 of group mesh_shard [ranks 0, 1] (4.0 KB, the host ran ahead of it); "
        "rank 2 waited in all_reduce #3 of group mesh_replicate [ranks 0, 2] (4.0 KB, the host ran ahead of it); "
        "rank 3 waited in all_reduce #3 of group mesh_replicate [ranks 1, 3] (4.0 KB, the host ran ahead of it) "
        "for 5 s (dist.timeout_s)")


def test_a_record_without_collectives_takes_its_ranks_nccl_dump_so_a_mismatch_stays_a_mismatch(
        tmp_path: Path) -> None:
    """Rank 1's own read of the recorder found nothing (its record's list is empty); its NCCL dump shows the
    collective #39 it called, which differs from rank 0's: a mismatch, not a hung rank 1."""
    folder = _folder(tmp_path)
    _nccl_dump(folder, 0, [(38, "all_reduce", 1024, "completed"), (39, "broadcast", 64, "scheduled")])
    _aborted_by_the_watchdog(folder, 0)
    _at(folder, 0, "forward", 4)
    _nccl_dump(folder, 1, [(38, "all_reduce", 1024, "completed"), (39, "all_reduce", 12, "scheduled")])
    _record(folder, 1, "SIGTERM from the launcher", 3, "after the update", [])
    line = verdict(tmp_path, [Failure(0, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")], 2, 15, "vm")
    assert line == ("mismatched collectives: as collective #39 the ranks called different ones: rank 0 broadcast of "
                    "64 bytes at step 4 in forward; rank 1 all_reduce of 12 bytes at step 3 in the end of the step "
                    "(after the update)")


def _gloo_trace(default: list[tuple[int, str, int]], checkpoint_seqs: int) -> dict[str, Any]:
    """A gloo rank's flight-recorder dump in torch 2.13's format: the default group's collectives, then the async
    checkpoint's background thread's on its own gloo group (numbered from 1 on that group); states stay
    ``scheduled`` on gloo and ``pg_config`` is empty."""
    from ddptrain.diagnose.trace import CHECKPOINT_GROUP

    def entry(pg: tuple[str, str], pg_id: int, seq: int, op: str, nbytes: int) -> dict[str, Any]:
        return {"pg_id": pg_id, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
                "profiling_name": f"gloo:{op}", "time_created_ns": 0, "input_sizes": [[nbytes // 4]],
                "input_dtypes": ["Float"], "output_sizes": [[nbytes // 4]], "output_dtypes": ["Float"],
                "state": "scheduled", "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                "retired": True, "timeout_ms": 300000, "is_p2p": False}

    entries = [entry(("0", "default_pg"), 0, s, op, b) for s, op, b in default]
    entries += [entry(("1", CHECKPOINT_GROUP), 1, s, "all_gather", 64) for s in range(1, checkpoint_seqs + 1)]
    return {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}, "comm_lib_version": "",
            "pg_status": {}, "entries": entries}


def test_the_async_checkpoints_group_is_never_read_as_the_trainings(tmp_path: Path) -> None:
    """On gloo the async checkpoint's writer thread records its own group's collectives (numbered 1, 2, ... there)
    after the training's in the ring; the verdict reads the training's groups only."""
    from ddptrain.diagnose.trace import read_trace

    folder = _folder(tmp_path)
    for rank, reason, step, phase, default in (
            (0, "collective timed out", 4, "loss mean", [(40, "all_reduce", 4096), (41, "all_reduce", 8)]),
            (1, "SIGTERM from the launcher", 4, "data", [(39, "all_reduce", 8), (40, "all_reduce", 4096)])):
        record = {"rank": rank, "host": "vm", "pid": 1, "time": 0.0, "reason": reason, "error": None, "step": step,
                  "phase": phase, "where": None, **read_trace(_gloo_trace(default, 60), nccl=False)}
        (folder / f"rank{rank}.json").write_text(json.dumps(record))
    assert verdict(tmp_path, [Failure(0, 1, None), Failure(1, -15, "SIGTERM")], 2, 15, "vm") == (
        "rank 1 (host vm) hung at step 4 in data loading; rank 0 waited in all_reduce #41 (the loss mean of a "
        "logging step of step 4, 8 bytes) for 15 s (dist.timeout_s)")


def _mesh_record(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddptrain.diagnose.evidence import flight_record
    from ddptrain.diagnose.trace import CHECKPOINT_GROUP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    side = dist.new_group(backend="gloo", group_desc=CHECKPOINT_GROUP)
    dist.all_reduce(torch.zeros(2), group=mesh.get_group("shard"))
    dist.all_reduce(torch.zeros(3), group=side)
    dist.all_reduce(torch.zeros(4), group=mesh.get_group("replicate"))
    return flight_record()


def test_a_ranks_record_holds_every_training_groups_collectives_with_the_groups_global_ranks() -> None:
    """Real gloo groups of a 2x2 device mesh: torch's dump leaves pg_config empty on gloo, the record fills each
    group's global ranks in; the checkpoint writer's group is left out."""
    from tests.helpers.dist import run_distributed

    for rank, record in enumerate(run_distributed(_mesh_record, 4)):
        shard, replicate = record["collectives"][-2:]
        assert (shard["op"], shard["bytes"], replicate["op"], replicate["bytes"]) == ("all_reduce", 8, "all_reduce", 16)
        groups = record["groups"]
        assert (groups[shard["group"]]["desc"], groups[replicate["group"]]["desc"]) == ("mesh_shard", "mesh_replicate")
        assert groups[shard["group"]]["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups[replicate["group"]]["ranks"] == [rank % 2, rank % 2 + 2]
        assert all(g["desc"] != "ddptrain_checkpoint" for g in groups.values()), groups


# ---- a group's first collective, one group name with other ranks on each rank, a peer stuck behind its own
# run-ahead, a pg_status behind the entries, pg_config's ranks (issues 51 and 52) -----------------------------------

FIRST_STATUS = {"last_enqueued_collective": 1, "last_started_collective": -1, "last_completed_collective": -1}


def _recorders_through_a_first_collective(rank: int, world_size: int) -> dict[str, Any] | None:
    """torch's own recorder (on gloo) and the twin's, through the same steps: before any collective, then with
    rank 0's first collective of a fresh group enqueued and rank 1 not yet in it (held back on a third group)."""
    import pickle

    import torch
    import torch.distributed as dist

    from tests.helpers import nccl_twin

    nccl_twin.install()
    real = lambda: pickle.loads(torch._C._distributed_c10d._dump_fr_trace())  # noqa: E731
    twin = lambda: pickle.loads(nccl_twin.RECORDER.dump())  # noqa: E731
    hold, gloo, twins = (dist.new_group(backend=b) for b in ("gloo", "gloo", nccl_twin.BACKEND))
    out = {"fresh": (real(), twin())}
    if rank == 0:
        works = [dist.all_reduce(torch.ones(2), group=gloo, async_op=True)]
        out["real"] = real()  # before the twin's inner gloo group records its own entry
        works.append(dist.all_reduce(torch.ones(2), group=twins, async_op=True))
        out["twin"] = twin()
        dist.barrier(group=hold)
        for work in works:
            work.wait()
    else:
        dist.barrier(group=hold)
        dist.all_reduce(torch.ones(2), group=gloo)
        dist.all_reduce(torch.ones(2), group=twins)
    return out if rank == 0 else None


def test_torchs_recorder_starts_a_groups_status_at_minus_one_and_the_twin_dumps_as_it_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.13 (c10d/logger.hpp) starts a group's ProcessGroupStatus at -1 and dumps it from the group's first
    entry on; collectives are numbered from 1. Pinned on torch's own recorder over gloo: nothing before any
    collective, then -1 completed with #1 enqueued; the reader takes that as none completed (no collective #0),
    and the twin's dump has torch's keys and these values at each step."""
    from ddptrain.diagnose.trace import read_trace
    from tests.helpers.dist import run_distributed

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    got = run_distributed(_recorders_through_a_first_collective, 2)[0]
    (real_fresh, twin_fresh), real, twin = got["fresh"], got["real"], got["twin"]
    assert real_fresh["pg_status"] == twin_fresh["pg_status"] == {} and real_fresh["entries"] == []
    assert set(real) == set(twin) and set(real_fresh) == set(twin_fresh), (sorted(real), sorted(twin))
    for dump in (real, twin):
        (entry,) = dump["entries"]
        assert dump["pg_status"] == {str(entry["pg_id"]): FIRST_STATUS}, dump["pg_status"]
        assert (entry["collective_seq_id"], entry["state"], entry["time_discovered_completed_ns"]) == (1, "scheduled",
                                                                                                      None)
        assert {k for c in dump["pg_config"].values() for k in c} == {"name", "desc", "ranks"}
    assert set(real["entries"][0]) == set(twin["entries"][0])
    read = read_trace(real, nccl=True)["collectives"]
    assert [(c["seq"], c["op"], c["completed"]) for c in read] == [(1, "all_reduce", False)], read


def test_on_nccl_a_hang_in_the_first_collective_names_the_rank_that_never_joined_it(tmp_path: Path) -> None:
    """Rank 1 hung in data loading before the job's first collective; rank 0's dump: #1 enqueued, the group's
    last completed -1 (torch's start: none)."""
    import pickle

    folder = _folder(tmp_path)
    _nccl_dump(folder, 0, [(1, "all_reduce", 8, "scheduled")])
    assert pickle.loads((folder / "nccl_trace_rank_0").read_bytes())["pg_status"]["0"] == FIRST_STATUS
    _aborted_by_the_watchdog(folder, 0)
    _at(folder, 0, "loss mean", 1)
    _record(folder, 1, "SIGTERM from the launcher", 1, "data", [], "ddptrain/train/observer.py:60")
    assert verdict(tmp_path, [Failure(0, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")], 2, 15, "vm") == (
        "rank 1 (host vm) hung at step 1 in data loading (ddptrain/train/observer.py:60); rank 0 waited in "
        "all_reduce #1 (the loss mean of a logging step of step 1, 8 bytes) for 15 s (dist.timeout_s)")


def _mesh_dump(folder: Path, rank: int, collectives: list[tuple[str, str, int, str]]) -> None:
    """Rank ``rank``'s dump on a 2x2 mesh named as torch names it: one name per mesh dimension on every rank
    ("1": the shard group, "2": the replicas'), each rank's own global ranks under it."""
    from tests.helpers.nccl_twin import nccl_dump

    groups = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("mesh_shard", [rank - rank % 2, rank - rank % 2 + 1]),
              "2": ("mesh_replicate", [rank % 2, rank % 2 + 2])}
    (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(_renumber(collectives), groups=groups))


def _mesh_step(states: tuple[str, str, str, str]) -> list[tuple[str, str, int, str]]:
    """One HSDP step on the mesh above (as ``_hsdp_step``)."""
    gathers, scatter, reduce, mean = states
    return [("1", "_allgather_base", 4096, gathers), ("1", "_allgather_base", 4096, gathers),
            ("1", "_reduce_scatter_base", 8192, scatter), ("2", "all_reduce", 4096, reduce),
            ("0", "all_reduce", 4, mean)]


def test_on_nccl_a_hang_in_a_mesh_groups_first_collective_names_the_late_rank(tmp_path: Path) -> None:
    """HSDP's first cross-node all-reduce: rank 2 hung in data loading at step 1. Ranks 0 and 1 got through their
    shard group's step and wait in their replica groups' first all-reduce (status -1 there); rank 3 waits in its
    shard group's first all-gather (status -1 there)."""
    folder = _folder(tmp_path)
    start = [("0", "broadcast", 64, "completed")]
    for rank in (0, 1):
        _mesh_dump(folder, rank, start + _mesh_step(("completed", "completed", "scheduled", "scheduled")))
        _at(folder, rank, "check", 1)
    _mesh_dump(folder, 3, start + [("1", "_allgather_base", 4096, "scheduled")] * 2)
    _at(folder, 3, "forward", 1)
    _mesh_dump(folder, 2, start)
    _record(folder, 2, "SIGTERM from the launcher", 1, "data", [], "ddptrain/train/observer.py:60")
    failures = [Failure(r, -6, "SIGABRT") for r in (0, 1, 3)] + [Failure(2, -15, "SIGTERM")]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "rank 2 (host vm) hung at step 1 in data loading (ddptrain/train/observer.py:60); rank 0 waited in "
        "all_reduce #1 of group mesh_replicate [ranks 0, 2] (4.0 KB, the host ran ahead of it); rank 1 waited in "
        "all_reduce #1 of group mesh_replicate [ranks 1, 3] (4.0 KB, the host ran ahead of it); rank 3 waited in "
        "all_gather_into_tensor #1 of group mesh_shard [ranks 2, 3] (4.0 KB, the host ran ahead of it) for 5 s "
        "(dist.timeout_s)")


def test_one_group_name_with_other_ranks_on_each_rank_is_read_with_each_ranks_own(tmp_path: Path) -> None:
    """torch names HSDP's replica group alike on every rank ("2": [0, 2] on ranks 0 and 2, [1, 3] on 1 and 3).
    Rank 3 stopped in backward at step 3 before its replicas' all-reduce: rank 1 waits in it for rank 3 alone;
    ranks 0 and 2 finished theirs and wait in the loss mean for both. Read with rank 0's [0, 2], rank 1 would
    wait for no one and be named as hung too."""
    folder = _folder(tmp_path)
    done = ("completed",) * 4
    for rank in range(4):
        steps = _mesh_step(done) * 2
        if rank in (0, 2):
            steps += _mesh_step(("completed", "completed", "completed", "scheduled"))
        if rank == 1:  # its host went no further than the all-reduce
            steps += _mesh_step(("completed", "completed", "scheduled", "scheduled"))[:4]
        if rank == 3:
            steps += _mesh_step(done)[:3]
        _mesh_dump(folder, rank, steps)
    for rank, phase in ((0, "check"), (1, "backward"), (2, "check")):
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, phase, 3)
    _record(folder, 3, "SIGTERM from the launcher", 3, "backward", [])
    failures = [Failure(r, -6, "SIGABRT") for r in (0, 1, 2)] + [Failure(3, -15, "SIGTERM")]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "rank 3 (host vm) hung at step 3 in backward; ranks 0, 2 waited in all_reduce #3 (the stop and non-finite "
        "check of step 3, 4 bytes); rank 1 waited in all_reduce #3 of group mesh_replicate [ranks 1, 3] (backward "
        "of step 3, 4.0 KB) for 5 s (dist.timeout_s)")


def test_a_peer_whose_host_ran_past_the_waiters_collective_but_is_stuck_before_it_is_behind(tmp_path: Path) -> None:
    """Rank 1's stream is stuck before its #8 (a small broadcast from rank 0, which completes on the root without
    the receiver, as does #9); its host enqueued on to #12. Rank 0 waits in #10: rank 1 enqueued #10 but is
    behind it, so it is the late one."""
    assert _run_ahead_verdict(tmp_path) == (
        "rank 1 (host vm) hung at step 3 in forward; rank 0 waited in all_reduce #10 (64 bytes, the host ran ahead "
        "of it) for 15 s (dist.timeout_s)")


def test_completion_is_read_from_the_entries_where_pg_status_lags_behind_them(tmp_path: Path) -> None:
    """Rank 0's pg_status says #2390 completed while its entries say up to #2400 (the two are written apart): it
    waits in #2401, which rank 1, hung in data loading after #2400, never enqueued."""
    import pickle

    from tests.helpers.nccl_twin import nccl_dump

    folder = _folder(tmp_path)
    dump = pickle.loads(nccl_dump(_run_ahead(2450, 2400), ring=100))
    dump["pg_status"]["0"]["last_completed_collective"] = 2390
    (folder / "nccl_trace_rank_0").write_bytes(pickle.dumps(dump, protocol=2))
    _aborted_by_the_watchdog(folder, 0)
    _at(folder, 0, "backward", 5)
    _record(folder, 1, "SIGTERM from the launcher", 5, "data", [(2400, "all_reduce", BUCKET)])
    line = verdict(tmp_path, [Failure(0, -6, "SIGABRT"), Failure(1, -15, "SIGTERM")], 2, 300, "vm")
    assert line == ("rank 1 (host vm) hung at step 5 in data loading; rank 0 waited in all_reduce #2401 (1.0 MB, the "
                    "host ran ahead of it) for 300 s (dist.timeout_s)")


def test_a_groups_ranks_are_read_from_pg_config_so_a_rank_without_its_collectives_is_named(tmp_path: Path) -> None:
    """Rank 1 waits in its replica group's #5; rank 3, the group's other rank, left no collective of it (its own
    read of the recorder found nothing, no dump): only pg_config's "[1, 3]" says rank 3 is in that group."""
    import pickle

    from ddptrain.diagnose.trace import read_trace

    folder = _folder(tmp_path)
    _mesh_dump(folder, 1, [("2", "all_reduce", 4096, "completed")] * 4 + [("2", "all_reduce", 4096, "scheduled")])
    assert read_trace(pickle.loads((folder / "nccl_trace_rank_1").read_bytes()), nccl=True)["groups"]["2"][
        "ranks"] == [1, 3]
    _aborted_by_the_watchdog(folder, 1)
    _at(folder, 1, "backward", 5)
    _record(folder, 3, "SIGTERM from the launcher", 5, "backward", [])
    assert verdict(tmp_path, [Failure(1, -6, "SIGABRT"), Failure(3, -15, "SIGTERM")], 4, 15, "vm") == (
        "rank 3 (host vm) hung at step 5 in backward; rank 1 waited in all_reduce #5 of group mesh_replicate "
        "[ranks 1, 3] (backward of step 5, 4.0 KB) for 15 s (dist.timeout_s)")


# ---- audit of issues 51/52's diagnose change: rules of the verdict no test pinned yet --------------------------------

def test_a_group_stuck_as_a_whole_in_one_collective_is_where_the_waiting_leads(tmp_path: Path) -> None:
    """HSDP on a 2x2 mesh: ranks 2 and 3 (one node) both enqueued their shard group's all-gather #7 of step 3 and
    are stuck in it together (neither is behind the other: an intra-node fault; rank 2's host enqueued #8 too,
    rank 3's only #7); ranks 0 and 1 finished their own shard step and wait in the replicas' all-reduce #3 for
    them. Ranks 2 and 3 wait for no one and are waited for: both are named. Counting a peer that enqueued just the
    waiter's collective, or is stuck in it too, as behind it (``<=`` for ``<``) drops one or both."""
    folder = _folder(tmp_path)
    done = ("completed",) * 4
    for rank in range(4):
        steps = _mesh_step(done) * 2
        if rank in (0, 1):
            steps += _mesh_step(("completed", "completed", "scheduled", "scheduled"))
        else:  # rank 2's host enqueued both all-gathers of step 3's forward, rank 3's the first; it never finished
            steps += [("1", "_allgather_base", 4096, "scheduled")] * (2 if rank == 2 else 1)
        _mesh_dump(folder, rank, steps)
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, "check" if rank < 2 else "forward", 3)
    failures = [Failure(r, -6, "SIGABRT") for r in range(4)]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "rank 2 (host vm) hung at step 3 in forward; rank 3 (host vm) hung at step 3 in forward; rank 0 waited in "
        "all_reduce #3 of group mesh_replicate [ranks 0, 2] (4.0 KB, the host ran ahead of it); rank 1 waited in "
        "all_reduce #3 of group mesh_replicate [ranks 1, 3] (4.0 KB, the host ran ahead of it) for 5 s "
        "(dist.timeout_s)")


def test_a_mismatch_in_one_replica_group_names_that_groups_ranks_only(tmp_path: Path) -> None:
    """HSDP on a 2x2 mesh, torch naming both replica groups "2": rank 3 called its replicas' all-reduce #3 of step 3
    with 2.0 KB where rank 1 called 4.0 KB; ranks 0 and 2 finished theirs (same name, their own group [0, 2]) and
    wait in the loss mean. The mismatch is between ranks 1 and 3; ranks 0 and 2 called #3 of another group and are
    no side of it."""
    folder = _folder(tmp_path)
    done = ("completed",) * 4
    for rank in range(4):
        reduce_bytes, reduce_state = (2048 if rank == 3 else 4096), ("completed" if rank in (0, 2) else "scheduled")
        steps = _mesh_step(done) * 2 + _mesh_step(done)[:3] + [("2", "all_reduce", reduce_bytes, reduce_state),
                                                               ("0", "all_reduce", 4, "scheduled")]
        _mesh_dump(folder, rank, steps)
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, "check", 3)
    failures = [Failure(r, -6, "SIGABRT") for r in range(4)]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "mismatched collectives: as collective #3 of group mesh_replicate [ranks 1, 3] the ranks called different "
        "ones: rank 1 all_reduce of 4.0 KB (the host ran ahead of it); rank 3 all_reduce of 2.0 KB (the host ran "
        "ahead of it)")


def test_a_rank_whose_nccl_dump_shows_every_collective_finished_is_not_a_waiter(tmp_path: Path) -> None:
    """Rank 1 was killed (SIGKILL) in forward; rank 0 waited in #41 for it. Rank 2's host was stuck outside any
    collective in native code (its SIGTERM handler never ran: no record; the agent killed it); NCCL's dump, written
    on rank 0's timeout, shows its #40 finished and nothing after. It waited in nothing: only rank 0 is named as
    having waited."""
    folder = _folder(tmp_path)
    _at(folder, 1, "forward", 4)
    _nccl_dump(folder, 0, [(40, "all_reduce", 1024, "completed"), (41, "all_reduce", 8, "scheduled")])
    _aborted_by_the_watchdog(folder, 0)
    _at(folder, 0, "loss mean", 4)
    _nccl_dump(folder, 2, [(40, "all_reduce", 1024, "completed")])
    _at(folder, 2, "data", 4)
    failures = [Failure(1, -9, "SIGKILL"), Failure(0, -6, "SIGABRT"), Failure(2, -9, "SIGKILL")]
    assert verdict(tmp_path, failures, 3, 15, "vm") == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 4 in forward; rank 0 waited in "
        "all_reduce #41 (the loss mean of a logging step of step 4, 8 bytes) for 15 s (dist.timeout_s)")


def test_a_peer_stuck_in_another_groups_earlier_collective_is_behind_the_waiter(tmp_path: Path) -> None:
    """HSDP on a 2x2 mesh: the cross-node link of replica pair [1, 3] fails in step 3's all-reduce #3. Ranks 1 and 3
    enqueued it and (their hosts running on) the loss mean #3 of the default group, which their streams run only
    after it; ranks 0 and 2 finished their replicas' all-reduce and wait in the loss mean. Ranks 1 and 3 enqueued
    the loss mean but are stuck in a collective they enqueued before it: behind ranks 0 and 2, and where the
    waiting leads. (Collective numbers of two groups say nothing about their order: both are #3 here.)"""
    folder = _folder(tmp_path)
    done = ("completed",) * 4
    for rank in range(4):
        stuck = ("completed", "completed", "completed" if rank in (0, 2) else "scheduled", "scheduled")
        _mesh_dump(folder, rank, _mesh_step(done) * 2 + _mesh_step(stuck))
        _aborted_by_the_watchdog(folder, rank)
        _at(folder, rank, "check", 3)
    failures = [Failure(r, -6, "SIGABRT") for r in range(4)]
    assert verdict(tmp_path, failures, 4, 5, "vm") == (
        "rank 1 (host vm) hung at step 3 in the stop and non-finite check; rank 3 (host vm) hung at step 3 in the "
        "stop and non-finite check; ranks 0, 2 waited in all_reduce #3 (the stop and non-finite check of step 3, 4 "
        "bytes) for 5 s (dist.timeout_s)")


def test_a_peer_stuck_before_the_waiters_collective_is_behind_when_its_ring_no_longer_holds_that_one(
        tmp_path: Path) -> None:
    """As the run-ahead case above, with rank 1's ring shrunk to its last 2 entries (#11, #12): its #10, the one
    rank 0 waits in, is gone from it, and its stuck #8 is known from pg_status only. It is still behind rank 0."""
    assert _run_ahead_verdict(tmp_path, ring_of_rank_1=2) == (
        "rank 1 (host vm) hung at step 3 in forward; rank 0 waited in all_reduce #10 (64 bytes, the host ran ahead "
        "of it) for 15 s (dist.timeout_s)")


# mutmut's survivors (docs/mutation.md): the death, late-rank and waiter cases no test above needed


def test_a_segfault_before_any_whereabouts_is_named_at_start_up_and_signals_of_the_launcher_are_no_cause(
        tmp_path: Path) -> None:
    """Ranks 2 and 3 ended by the launcher (SIGTERM, SIGINT) without evidence are listed first and are not the
    cause; rank 1's crash outside torch.distributed is named with its frame, before it wrote any whereabouts."""
    folder = _folder(tmp_path)
    (folder / "rank1.stacks").write_text(
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/x/ddptrain/models/gpt.py", line 10 in forward\n'
        '  File "/x/ddptrain/train/loop.py", line 120 in train\n\nThread 0x2:\n')
    _record(folder, 0, "collective timed out", 0, "start-up", [(1, "broadcast", 64)])
    failures = [Failure(2, -15, "SIGTERM"), Failure(3, -2, "SIGINT"), Failure(1, -11, "SIGSEGV"), Failure(0, 1, None)]
    assert verdict(tmp_path, failures, 4, 15, "vm") == (
        "rank 1 (host vm) died of SIGSEGV (a crash in native code) at step 0 in start-up (ddptrain/models/gpt.py:10); "
        "rank 0 waited in broadcast #1 (start-up of step 0, 64 bytes) for 15 s (dist.timeout_s)")


def test_a_phase_the_verdict_has_no_words_for_is_printed_as_recorded(tmp_path: Path) -> None:
    # a record or whereabouts from another version of the loop: its phase, not "None"
    folder = _folder(tmp_path)
    where = Whereabouts()
    where.open(folder / "rank1.where")
    where.at("warm-up", 2)
    assert verdict(tmp_path, [Failure(1, -9, "SIGKILL")], 2, 15, "vm") == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 2 in warm-up")
    where.at("data", 2)  # and a phase it has words for, in them
    assert verdict(tmp_path, [Failure(1, -9, "SIGKILL")], 2, 15, "vm") == (
        "rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 2 in data loading")
    (folder / "rank1.where").unlink()
    _record(folder, 0, "collective timed out", 2, "forward", [(7, "all_reduce", 8)])
    _record(folder, 1, "SIGTERM from the launcher", 2, "warm-up", [(6, "all_reduce", 8)])
    record = json.loads((folder / "rank1.json").read_text())
    (folder / "rank1.json").write_text(json.dumps({**record, "host": "node-b"}))
    line = verdict(tmp_path, [Failure(0, 1, None)], 2, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host node-b) hung at step 2 in warm-up;"), line


def test_late_ranks_without_a_record_are_named_from_their_whereabouts_or_at_start_up(tmp_path: Path) -> None:
    """Rank 0 is known only from its NCCL dump (aborted by the watchdog, no whereabouts yet); rank 1 left only its
    whereabouts, rank 2 nothing: both late, each named where it was, on the launcher's host."""
    from tests.helpers.nccl_twin import nccl_dump

    folder = _folder(tmp_path)
    dump = nccl_dump([(1, "all_reduce", 8, "started")], groups={"0": ("default_pg", [0, 1, 2])})
    (folder / "nccl_trace_rank_0").write_bytes(dump)
    _at(folder, 1, "data", 5)
    line = verdict(tmp_path, [Failure(0, -6, "SIGABRT")], 3, 15, "vm")
    assert line == ("rank 1 (host vm) hung at step 5 in data loading; rank 2 (host vm) hung at step 0 in start-up; "
                    "rank 0 waited in all_reduce #1 (start-up of step 0, 8 bytes) for 15 s (dist.timeout_s)")


def test_waiters_without_collective_numbers_name_the_ranks_that_are_not_waiting(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _record(folder, 0, "collective timed out", 1, "forward", [])
    assert verdict(tmp_path, [Failure(0, 1, None)], 2, 15, "vm") == (
        "rank 1 (host vm) hung at step 0 in start-up; rank 0 waited in a collective (forward of step 1) for 15 s "
        "(dist.timeout_s)")


def test_a_rank_whose_record_shows_an_unfinished_collective_waited_whatever_stopped_it(tmp_path: Path) -> None:
    # both ranks stopped by the launcher (reason SIGTERM), but rank 0's record holds a collective it had not finished
    folder = _folder(tmp_path)
    _record(folder, 0, "SIGTERM from the launcher", 3, "backward", [(40, "all_reduce", 1024), (41, "all_reduce", 8)])
    record = json.loads((folder / "rank0.json").read_text())
    record["collectives"][-1]["completed"] = False
    (folder / "rank0.json").write_text(json.dumps(record))
    _record(folder, 1, "SIGTERM from the launcher", 3, "data", [(40, "all_reduce", 1024)])
    line = verdict(tmp_path, [Failure(0, -15, "SIGTERM"), Failure(1, -15, "SIGTERM")], 2, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host vm) hung at step 3 in data loading; rank 0 waited in "
                                                "all_reduce #41"), line


def test_a_ranks_record_says_who_where_and_why_and_only_the_first_cause(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Evidence in-process: the record of an error raised in ddptrain (its frame), of a frame given (a signal's),
    and of neither (the main thread's stack), with the rank, host, process, time, step, phase and the stacks."""
    import faulthandler
    import os
    import signal
    import socket
    import sys
    import time

    from ddptrain.diagnose import evidence
    from ddptrain.diagnose.evidence import TIMED_OUT, Evidence
    from ddptrain.diagnose.whereabouts import WHEREABOUTS
    from ddptrain.errors import flat
    from ddptrain.runtime.process_group import DistEnv, main_first

    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # recorded: Evidence sets them
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(evidence, "_ACTIVE", None)
    alone = DistEnv(0, 0, 1, 1)
    previous, opened = signal.getsignal(signal.SIGTERM), []
    (tmp_path / HANG_DIR).mkdir()  # a previous attempt's folder and record
    (tmp_path / HANG_DIR / "rank3.json").write_text("{}")
    try:
        begin = time.time()
        opened.append(ev := Evidence(tmp_path, 3))
        assert not (tmp_path / HANG_DIR / "rank3.json").exists()
        WHEREABOUTS.at("backward", 7)
        try:
            flat(None)  # type: ignore[arg-type]
        except AttributeError as exc:
            ev.record(TIMED_OUT, exc)
        ev.record("SIGTERM from the launcher")  # a later cause: the first one stays
        text = (tmp_path / HANG_DIR / "rank3.json").read_text()
        assert text.endswith("}\n") and text.count("\n") == 1
        record = json.loads(text)
        assert begin <= record.pop("time") <= time.time()
        assert record.pop("where").startswith("ddptrain/errors.py:")
        assert isinstance(record.pop("collectives"), list) and isinstance(record.pop("groups"), dict)
        assert record == {"rank": 3, "host": socket.gethostname(), "pid": os.getpid(), "reason": TIMED_OUT,
                          "error": "AttributeError: 'NoneType' object has no attribute 'split'", "step": 7,
                          "phase": "backward"}
        stacks = (tmp_path / HANG_DIR / "rank3.stacks").read_text()
        assert stacks.count("every thread's stack") == 1
        # the calling thread among every thread (faulthandler lists them in its own order: under xdist execnet's
        # reader thread may come first)
        header = "--- collective timed out: every thread's stack ---\n"
        assert header in stacks and "Current thread" in stacks.split(header, 1)[1], stacks[:300]

        opened.append(ev := Evidence(tmp_path, 4))
        frame = main_first(alone, lambda: sys._getframe(1), timeout_s=1)  # a frame inside ddptrain, as a signal's
        ev.record("SIGTERM from the launcher", frame=frame)
        record = json.loads((tmp_path / HANG_DIR / "rank4.json").read_text())
        assert record["error"] is None and record["reason"] == "SIGTERM from the launcher"
        assert record["where"].startswith("ddptrain/runtime/process_group.py:"), record["where"]

        opened.append(ev := Evidence(tmp_path, 5))
        main_first(alone, lambda: ev.record("stopped"), timeout_s=1)  # neither: where the main thread is
        record = json.loads((tmp_path / HANG_DIR / "rank5.json").read_text())
        assert record["where"].startswith("ddptrain/runtime/process_group.py:"), record["where"]
    finally:
        WHEREABOUTS.close()
        faulthandler.enable(sys.__stderr__, all_threads=True)
        signal.signal(signal.SIGTERM, previous)
        for ev in opened:
            ev._stacks.close()


def test_a_sigterm_before_the_loop_records_then_dies_of_the_signal_and_a_lost_peer_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evidence in-process, with ``os.kill`` faked (the handler re-raises the signal on its own process): SIGTERM's
    handler records with the signal's frame, puts back the handler it replaced (the signal's default when that was
    not a function, so the process dies of it as before) and sends the signal again. ``lost_peer`` records only
    an error that says a collective timed out or lost its peer, with the error's first non-blank line."""
    import faulthandler
    import os
    import signal
    import sys

    from ddptrain.diagnose import evidence
    from ddptrain.diagnose.evidence import TIMED_OUT, Evidence, _first_line
    from ddptrain.diagnose.whereabouts import WHEREABOUTS
    from ddptrain.runtime.process_group import DistEnv, main_first

    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # recorded: Evidence sets them
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(evidence, "_ACTIVE", None)
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: killed.append((pid, signum)))
    previous, opened = signal.getsignal(signal.SIGTERM), []

    def before(signum: int, frame: object) -> None:  # the handler Evidence replaces
        raise AssertionError("not called: os.kill is faked")

    def read(rank: int) -> dict[str, Any]:
        return json.loads((tmp_path / HANG_DIR / f"rank{rank}.json").read_text())

    try:
        signal.signal(signal.SIGTERM, before)
        (tmp_path / HANG_DIR).mkdir()
        (tmp_path / HANG_DIR / "nccl_trace_rank_2").write_bytes(b"a previous attempt's")
        opened.append(ev := Evidence(tmp_path, 2))
        assert signal.getsignal(signal.SIGTERM) == ev._on_sigterm and evidence._ACTIVE is ev
        assert not (tmp_path / HANG_DIR / "nccl_trace_rank_2").exists()
        frame = main_first(DistEnv(0, 0, 1, 1), lambda: sys._getframe(1), timeout_s=1)  # inside ddptrain
        ev._on_sigterm(signal.SIGTERM, frame)
        record = read(2)
        assert record["reason"] == "SIGTERM from the launcher", record
        assert record["where"].startswith("ddptrain/runtime/process_group.py:"), record["where"]
        assert signal.getsignal(signal.SIGTERM) is before and killed == [(os.getpid(), signal.SIGTERM)]

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # not a function: the default follows, and kills
        opened.append(ev := Evidence(tmp_path, 3))
        ev._on_sigterm(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and len(killed) == 2
        signal.signal(signal.SIGTERM, before)

        opened.append(ev := Evidence(tmp_path, 4))
        assert ev.lost_peer(ValueError("the shapes differ")) is None
        assert not (tmp_path / HANG_DIR / "rank4.json").exists()
        lost = ev.lost_peer(RuntimeError("\n \t\n  [pair.cc:534] Connection closed by peer [10.0.0.2]:5012  \nmore"))
        assert lost == read(4) and lost is not None
        assert (lost["reason"], lost["error"]) == (TIMED_OUT, "RuntimeError: [pair.cc:534] Connection closed by peer "
                                                              "[10.0.0.2]:5012")

        # the stop handler's call (record_evidence) records into the evidence installed last, with its frame
        opened.append(ev := Evidence(tmp_path, 5))
        evidence.record_evidence("SIGTERM from the launcher", frame=frame)
        assert (read(5)["reason"], read(5)["where"]) == ("SIGTERM from the launcher", record["where"])
        # a rank that ended well: its files go, hang/ stays while another rank's are there; the installed evidence
        # is dropped only by its own discard
        opened.append(healthy := Evidence(tmp_path / "healthy", 0))
        opened.append(other := Evidence(tmp_path / "healthy", 1))
        (tmp_path / "healthy" / HANG_DIR / "rank1.stacks").unlink()  # a file already gone does not stop it
        healthy.discard()
        assert sorted(p.name for p in (tmp_path / "healthy" / HANG_DIR).iterdir()) == ["rank1.where"]
        assert evidence._ACTIVE is other
        other.discard()
        assert not (tmp_path / "healthy" / HANG_DIR).exists() and evidence._ACTIVE is None
    finally:
        WHEREABOUTS.close()
        faulthandler.enable(sys.__stderr__, all_threads=True)
        signal.signal(signal.SIGTERM, previous)
        for ev in opened:
            ev._stacks.close()
    assert _first_line(RuntimeError("")) == "RuntimeError: "
    assert _first_line(TimeoutError("x" * 250 + "\nsecond")) == "TimeoutError: " + "x" * 200


def test_a_record_reads_torchs_recorder_without_stacks_and_fills_gloos_group_ranks_from_this_processs_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's recorder API faked with its real names and semantics: ``_dump_fr_trace(includeCollectives,
    includeStackTraces, onlyActive)`` (None: torch's default, True, True, False) as gloo dumps it (no group's
    ranks), ``_dump_nccl_trace`` absent (a CPU build) or raising, and ``distributed_c10d._get_all_pg_configs`` as
    torch returns it. The record asks for every collective without stack traces (collecting them for a full ring
    takes time), and takes each group's ranks from this process's groups where the dump has none."""
    import pickle

    import torch
    from torch.distributed import distributed_c10d

    from ddptrain.diagnose.evidence import flight_record
    from tests.helpers.nccl_twin import nccl_dump

    gloo = pickle.loads(nccl_dump([(6, "all_reduce", 8, "completed"), (7, "broadcast", 64, "scheduled"),
                                   ("5", 3, "all_reduce", 8, "scheduled")], groups={"5": ("mesh_shard", [1, 3])}))
    gloo["pg_config"] = {}
    stacks: list[bool] = []

    def dump_fr_trace(includeCollectives: bool | None = None, includeStackTraces: bool | None = None,
                      onlyActive: bool | None = None) -> bytes:
        stacks.append(includeStackTraces is not False)
        entries = [] if includeCollectives is False else [
            e for e in gloo["entries"] if not (onlyActive and e["state"] == "completed")]
        return pickle.dumps({**gloo, "entries": entries})

    def no_nccl(*_: object) -> bytes:
        raise RuntimeError("no NCCL process group")

    configs = [{"pg_name": name, "pg_desc": desc, "backend_config": "cpu:gloo", "pg_size": len(ranks), "ranks": ranks}
               for name, desc, ranks in (("0", "default_pg", [0, 1, 2, 3]), ("5", "mesh_shard", [1, 3]),
                                         ("9", "mesh_replicate", [1, 3]))]  # 9: no collective in the ring
    c10d = torch._C._distributed_c10d
    monkeypatch.delattr(c10d, "_dump_nccl_trace", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", dump_fr_trace)
    monkeypatch.setattr(distributed_c10d, "_get_all_pg_configs", lambda: configs)
    expected = {"collectives": [{"group": "0", "seq": 6, "op": "all_reduce", "sizes": [[2]], "bytes": 8},
                                {"group": "0", "seq": 7, "op": "broadcast", "sizes": [[16]], "bytes": 64},
                                {"group": "5", "seq": 3, "op": "all_reduce", "sizes": [[2]], "bytes": 8}],
                "groups": {"0": {"desc": "default_pg", "ranks": [0, 1, 2, 3]},
                           "5": {"desc": "mesh_shard", "ranks": [1, 3]}}}
    assert flight_record() == expected and stacks == [False]
    monkeypatch.setattr(c10d, "_dump_nccl_trace", no_nccl, raising=False)  # a CUDA build without NCCL's recorder
    assert flight_record() == expected
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    monkeypatch.delattr(c10d, "_dump_fr_trace")  # a torch without either: no entries, not an error
    assert flight_record() == {"collectives": [], "groups": {}}


def test_whereabouts_start_at_start_up_keep_a_phase_in_memory_until_opened_and_stop_writing_when_closed(
        tmp_path: Path) -> None:
    """A fresh rank is at step 0 in start-up; phases before ``open`` are written when it opens (into a folder it
    makes); after ``close`` the file keeps the last phase written; a phase cut at 32 bytes inside a character reads
    with a replacement character, not an error."""
    fresh = Whereabouts()
    fresh.open(tmp_path / "fresh")
    assert read_whereabouts(tmp_path / "fresh") == (0, "start-up")
    fresh.close()
    where = Whereabouts()
    where.at("forward", 3)  # no file yet: kept in memory
    where.open(tmp_path / "a" / "b" / "w")
    assert read_whereabouts(tmp_path / "a" / "b" / "w") == (3, "forward")
    where.at("x" + "é" * 20)  # 41 bytes of UTF-8: the 32nd is the first half of an é
    assert read_whereabouts(tmp_path / "a" / "b" / "w") == (3, "x" + "é" * 15 + "\ufffd")
    where.close()
    where.at("backward", 4)
    assert read_whereabouts(tmp_path / "a" / "b" / "w") == (3, "x" + "é" * 15 + "\ufffd")
    assert (where.step, where.phase) == (4, "backward")


def test_a_groups_ranks_the_current_collective_and_a_size_at_their_edges() -> None:
    """``pg_config``'s ranks as torch writes them (a string) or already a list, and what is not a list of ranks;
    a rank with no collective is in none; 1 KiB is the first size in KB."""
    from ddptrain.diagnose.trace import _ranks, current
    from ddptrain.diagnose.verdict import _size

    assert (_ranks("[1, 3]"), _ranks([1, 3]), _ranks("[]"), _ranks("['a', 'b']"), _ranks("[0, 'x']")) == (
        [1, 3], [1, 3], None, None, None)
    assert current([]) is None and current(None) is None
    assert (_size(1023), _size(1024), _size(2**20)) == ("1023 bytes", "1.0 KB", "1.0 MB")


def test_the_innermost_ddptrain_frame_of_a_frames_stack_is_the_callers_not_an_outer_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame inside ``main_only`` called from a callback of ``main_first`` (two ddptrain frames on its stack,
    at different lines): where is the inner one."""
    import sys

    import torch.distributed as dist

    from ddptrain.diagnose.evidence import innermost
    from ddptrain.runtime.process_group import DistEnv, main_first, main_only

    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    found: list[tuple[str | None, int]] = []

    def look() -> None:  # called by main_only: its frame is the caller's, read while it runs
        frame = sys._getframe(1)
        found.append((innermost(None, frame), frame.f_lineno))

    main_first(DistEnv(0, 0, 1, 1), lambda: main_only(look, 1.0, "checkpoint.export_timeout_s", "exporting"), 1.0)
    (where, line), = found
    assert where == f"ddptrain/runtime/process_group.py:{line}"  # main_only's line, not main_first's


def test_a_stacks_file_gives_the_first_threads_ddptrain_frame_of_the_first_fatal_error(tmp_path: Path) -> None:
    """faulthandler's dump: bytes that are not UTF-8 are read, not refused; of two fatal errors the first is the
    cause; a ddptrain frame only in a later thread is not where the crashed thread was."""
    from ddptrain.diagnose.verdict import _stack_frame

    def crash(frame: str) -> str:
        return ("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
                '  File "/x/torch/distributed/distributed_c10d.py", line 2900 in all_reduce\n'
                f'  File "/x/{frame}", line 46 in global_mean\n\nThread 0x2:\n  File "/x/ddptrain/data/loader.py", '
                "line 9 in run\n")

    path = tmp_path / "rank1.stacks"
    path.write_bytes(b"\xff a thread name\n" + crash("ddptrain/step/compute.py").encode()
                     + crash("ddptrain/train/loop.py").encode())
    assert _stack_frame(path) == ("ddptrain/step/compute.py:46", True)
    path.write_text(crash("torch/nn/modules/module.py"))  # the crashed thread ran no ddptrain code
    assert _stack_frame(path) is None


def test_late_ranks_when_a_waiter_has_no_collective_and_when_no_waiter_has_one() -> None:
    """A waiter with no collective does not end the search (the next waiter's peers are behind it); with no
    collective numbers at all, the ranks not waiting are the late ones. A peer whose group's last collective
    completed before the waited number, or that has no collective of the group, is not stuck before it."""
    from ddptrain.diagnose.verdict import _Groups, _late, _stuck_before

    traces = {1: [{"group": "0", "seq": 41, "op": "all_reduce", "completed": False}],
              2: [{"group": "0", "seq": 40, "op": "all_reduce", "completed": True}]}
    waiters: dict[int, dict[str, Any]] = {0: {}, 1: {}}  # rank 0 first: waiting, its collectives unknown
    assert _late(waiters, traces, _Groups(3, {}, traces), 3) == {0, 2}
    assert _late(waiters, {}, _Groups(4, {}, {}), 4) == {2, 3}
    other_group = [{"group": "0", "seq": 3, "op": "all_reduce", "completed": True},
                   {"group": "1", "seq": 7, "op": "all_gather", "completed": False}]
    assert not _stuck_before(other_group, "0", 5)  # its last of group 0 completed
    assert not _stuck_before(other_group, "2", 5)  # nothing of group 2
