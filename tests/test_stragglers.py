"""Stragglers named: every rank's window timing gathered, the slowest rank and its skew, one warning with the cause."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ddptrain.errors import ConfigError
from ddptrain.runtime.topology import check_shared_run_dir
from ddptrain.telemetry.stragglers import skew, wait_for_slowest_pct
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each

BASE = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 6, "log_every": 1, "eval_every": 0},
    "metrics": {"straggler_windows": 4},
}


def _train_capturing_warnings(rank: int, world_size: int, tmp: str, fault: str, threshold_pct: float
                              ) -> tuple[list[dict], list[str]]:
    import os

    os.environ["DDPTRAIN_FAULT"] = fault
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ddptrain").addHandler(handler)
    (result,) = train_each(rank, world_size, tmp, BASE, [{"metrics": {"straggler_pct": threshold_pct}}])
    return result["metrics"], [r for r in records if r.startswith("straggler")]


@pytest.mark.parametrize("phase", ["data", "forward"])
def test_a_delayed_rank_is_named_slowest_with_its_cause(tmp_path: Path, phase: str) -> None:
    # 10%: on a loaded machine every rank's compute swells, and 100 ms (four of this model's ~25 ms steps) shrinks
    # against it
    metrics, warnings = run_distributed(_train_capturing_warnings, 2, str(tmp_path), f"delay@{phase}:1:1:100", 10.0,
                                        timeout=600)[0]
    assert all(len(m["rank_step_s"]) == len(m["rank_data_s"]) == len(m["rank_compute_s"]) == 2 for m in metrics)
    named = [m["slowest_rank"] == 1 and m["rank_skew_pct"] > 10.0 for m in metrics]
    assert sum(named) > len(named) // 2, [(m["slowest_rank"], m["rank_skew_pct"]) for m in metrics]
    # what the skew costs, for the predictor: the mean over ranks of the slowest's busy time less their own
    for m in metrics:
        busy = [c + d for c, d in zip(m["rank_compute_s"], m["rank_data_s"], strict=True)]
        assert m["rank_wait_for_slowest_pct"] == pytest.approx(100 * (max(busy) - sum(busy) / 2) / (sum(busy) / 2))
    assert sum(m["rank_wait_for_slowest_pct"] > 5.0 for m in metrics) > len(metrics) // 2
    # rank 0 waits for rank 1 at the step's first collective (DDP's buffer broadcast): its wait holds the delay
    assert sum(m["rank_wait_s"][0] for m in metrics) > sum(m["rank_wait_s"][1] for m in metrics)
    cause = "data" if phase == "data" else "compute"
    assert len(warnings) == 1 and "rank 1 on " in warnings[0] and f"; {cause} +" in warnings[0], warnings


def test_no_straggler_warning_without_a_delay(tmp_path: Path) -> None:
    # 50%: this model's ~25 ms step varies by a third between ranks on a loaded 2-core machine
    metrics, warnings = run_distributed(_train_capturing_warnings, 2, str(tmp_path), "", 50.0, timeout=600)[0]
    assert warnings == [] and all("rank_skew_pct" in m for m in metrics)


def test_skew_is_the_slowest_rank_against_the_median() -> None:
    assert skew([1.0, 1.0, 1.5, 1.0]) == (2, 50.0)
    assert skew([2.0, 2.0]) == (0, 0.0)


def test_the_wait_for_the_slowest_rank_is_the_mean_over_ranks_of_its_lead() -> None:
    # three ranks busy 1 s wait 0.5 s each for the one busy 1.5 s, which waits for none: 0.375 s of 1.125 s
    assert wait_for_slowest_pct([1.0, 1.0, 1.5, 1.0]) == pytest.approx(100 * 0.375 / 1.125)
    assert wait_for_slowest_pct([1.0, 3.0]) == pytest.approx(50.0) and wait_for_slowest_pct([2.0, 2.0]) == 0.0
    assert wait_for_slowest_pct([0.0, 0.0]) == 0.0


def _check_storage(rank: int, world_size: int, shared: str, private: str) -> str:
    try:
        check_shared_run_dir(Path(shared if rank == 0 else private))
    except ConfigError as exc:
        return str(exc)
    return "shared"


def test_a_run_dir_that_another_node_cannot_see_is_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert run_distributed(_check_storage, 2, str(tmp_path / "a"), str(tmp_path / "a")) == ["shared", "shared"]
    errors = run_distributed(_check_storage, 2, str(tmp_path / "a"), str(tmp_path / "b"))
    assert all("not shared by every node (rank(s) 1 (" in e for e in errors), errors
    assert not list((tmp_path / "a").iterdir()), "the probe file is removed"


def test_the_shared_run_dir_check_in_process_names_the_ranks_that_miss_rank_0s_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank's side of the check with torch.distributed's calls recorded (the test above runs it in forked ranks,
    where mutmut cannot see it): rank 0 writes the probe, every rank looks, rank 0 removes it after the last
    barrier; rank 1's side looks for rank 0's probe name and leaves the file alone."""
    import socket

    import torch.distributed as dist

    calls: list[object] = []
    peers: list[tuple[bool, str]] = []
    state = {"rank": 0, "shared": True}

    def broadcast(box: list[object], src: int) -> None:
        calls.append(("broadcast", src, box[0] is None))
        if state["rank"] != 0:  # rank 0's probe name, its file there when the directory is shared
            box[0] = ".shared-probe-0123456789abcdef"
            if state["shared"]:
                (tmp_path / str(box[0])).touch()

    def gather(every: list[tuple[bool, str]], seen: tuple[bool, str]) -> None:
        assert len(every) == 3
        calls.append(("gather", seen))
        every[:] = [seen, *peers] if state["rank"] == 0 else [(True, "node-a"), seen, *peers]

    def barrier() -> None:
        calls.append(("barrier", sorted(p.name for p in tmp_path.iterdir())))

    for name, fn in (("get_rank", lambda: state["rank"]), ("get_world_size", lambda: 3),
                     ("broadcast_object_list", broadcast), ("all_gather_object", gather), ("barrier", barrier)):
        monkeypatch.setattr(dist, name, fn)
    host = socket.gethostname()
    peers[:] = [(True, "node-b"), (False, "node-c")]
    with pytest.raises(ConfigError) as caught:
        check_shared_run_dir(tmp_path)
    assert str(caught.value) == (
        f"hydra.run.dir={tmp_path}: not shared by every node (rank(s) 2 (node-c) cannot see rank 0's files); put the "
        "run directory on a filesystem every node mounts: checkpoints need every rank's files in one place")
    probe = calls[1][1][0]  # type: ignore[index]
    assert probe.startswith(".shared-probe-") and len(probe) == len(".shared-probe-") + 16
    assert calls == [("broadcast", 0, False), ("barrier", [probe]), ("gather", (True, host)), ("barrier", [probe])]
    assert list(tmp_path.iterdir()) == []  # rank 0 removed its probe after every rank looked
    calls.clear()
    peers[:] = [(True, "node-c")]
    state["rank"] = 1
    check_shared_run_dir(tmp_path)  # rank 1 of a shared directory: found, nothing removed
    assert calls[0] == ("broadcast", 0, True) and calls[2] == ("gather", (True, host))
    assert [p.name for p in tmp_path.iterdir()] == [".shared-probe-0123456789abcdef"]
    state["shared"] = False
    (tmp_path / ".shared-probe-0123456789abcdef").unlink()
    with pytest.raises(ConfigError, match=rf"rank\(s\) 1 \({host}\) cannot see"):
        check_shared_run_dir(tmp_path)


def test_the_topology_line_names_nodes_ranks_per_node_and_at_most_four_hosts() -> None:
    from ddptrain.runtime.topology import Topology

    five = Topology(["e", "a", "b", "c", "d", "a"], [0, 0, 1, 1, 2, 2], 2)
    assert five.describe() == "3 node(s) x 2 rank(s) per node on 5 host(s): a, b, c, d ..."
    four = Topology(["d", "c", "b", "a"], [0, 1, 2, 3], 1)
    assert four.describe() == "4 node(s) x 1 rank(s) per node on 4 host(s): a, b, c, d"


def test_the_topology_is_gathered_from_every_ranks_host_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank's side of the gather, torch.distributed's call faked: rank 1 on node 1 of 3 ranks a node."""
    import socket

    import torch.distributed as dist

    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.runtime.topology import Topology, gather_topology

    host = socket.gethostname()

    def gather(every: list[tuple[str, int]], mine: tuple[str, int]) -> None:
        assert every == [mine, mine] and mine == (host, 1)
        every[:] = [("node-a", 0), mine]

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    env = DistEnv(rank=1, local_rank=0, world_size=2, local_world_size=3, node_rank=1)
    assert gather_topology(env) == Topology(["node-a", host], [0, 1], 3)
