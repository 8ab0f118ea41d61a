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
        '  File "/x/ddptrain/train/step.py", line 46 in global_mean\n'
        '  File "/x/ddptrain/train/loop.py", line 120 in train\n\nThread 0x2:\n')
    line = verdict(tmp_path, [Failure(1, -6, "SIGABRT")], 2, 15, "vm")
    assert line is not None and line.startswith("rank 1 (host vm) aborted (SIGABRT) inside a collective at step 0 "
                                                "(ddptrain/train/step.py:46): its collective does not match")


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
    return flight_record()


def test_the_flight_recorder_is_on_by_default_and_records_gloo_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddptrain.config.schema import DistConfig
    from ddptrain.diagnose.evidence import enable_flight_recorder
    from tests.helpers.dist import run_distributed

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    enable_flight_recorder(DistConfig().flight_recorder)  # what every worker does before its process group exists
    import os

    assert int(os.environ["TORCH_FR_BUFFER_SIZE"]) == DistConfig().flight_recorder > 0
    for rank_record in run_distributed(_collectives, 2):
        (reduce, barrier) = rank_record[-2:]
        assert (reduce["op"], reduce["bytes"], barrier["op"]) == ("all_reduce", 8, "barrier")
        assert barrier["seq"] == reduce["seq"] + 1


# --- NCCL: the watchdog aborts a waiting rank (SIGABRT, no Python exception, no record of its own); its flight
# recorder dump in <run dir>/hang/ says what it waited in. Dumps are written in torch's format (tests/helpers).

def _nccl_dump(folder: Path, rank: int, collectives: list[tuple[int, str, int, str]]) -> None:
    from tests.helpers.nccl_twin import nccl_dump

    (folder / f"nccl_trace_rank_{rank}").write_bytes(nccl_dump(collectives))


def _aborted_by_the_watchdog(folder: Path, rank: int) -> None:
    """What faulthandler writes when NCCL's watchdog thread calls abort(): no "Current thread" (the aborting
    thread is not Python's), the main thread blocked wherever the host last synchronized."""
    (folder / f"rank{rank}.stacks").write_text(
        "Fatal Python error: Aborted\n\nThread 0x2 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 2900 in all_reduce\n'
        '  File "/x/ddptrain/train/step.py", line 46 in global_mean\n'
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


def test_a_record_takes_its_collectives_from_the_nccl_trace_when_it_holds_the_default_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ddptrain.diagnose.evidence import flight_record
    from tests.helpers.nccl_twin import nccl_dump

    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda: nccl_dump([(7, "broadcast", 64, "scheduled")]), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda: nccl_dump([(40, "all_reduce", 8, "completed"),
                                                                     (41, "all_reduce_barrier", 4, "started")]),
                        raising=False)
    assert [(c["seq"], c["op"], c["completed"]) for c in flight_record()] == [(40, "all_reduce", True),
                                                                                (41, "barrier", False)]
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda: nccl_dump([]), raising=False)  # a CUDA build on gloo
    assert [(c["seq"], c["op"]) for c in flight_record()] == [(7, "broadcast")]
    assert "completed" not in flight_record()[0]  # gloo's entries stay "scheduled": their state says nothing


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


def _dump_to_file(rank: int, world_size: int, folder: str) -> list[dict[str, Any]] | None:
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
        assert read is not None and [c["op"] for c in read[-2:]] == ["all_reduce", "barrier"], read
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
