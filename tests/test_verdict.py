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
