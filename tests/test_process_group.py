"""The process group a run joins: a one-rank run outside torchrun needs no port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.runtime.process_group import DistEnv
from tests.helpers import procs

REPO = Path(__file__).parents[1]

# One in-process run: its group works (a collective, the store that main_first/main_only wait on) and it never
# asked for a TCP port, so two of them started together on one machine cannot collide on one.
ONE_RANK_RUN = """
import os
import torch
import torch.distributed as dist
from ddptrain.config.schema import DistConfig
from ddptrain.runtime.process_group import distributed, main_only
with distributed(DistConfig()) as (env, device):
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    done = []
    main_only(lambda: done.append(1), 5.0, "checkpoint.export_timeout_s", "exporting")
    assert done == [1]
    print("port", os.environ.get("MASTER_PORT"), "addr", os.environ.get("MASTER_ADDR"))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**env, "PYTHONPATH": str(REPO)}


@pytest.mark.slow  # two fresh interpreters, each importing torch: a check of processes, not of a loop
def test_one_rank_runs_started_together_need_no_port_and_both_train() -> None:
    runs = [procs.start([sys.executable, "-c", ONE_RANK_RUN], env=_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        assert out.strip() == "port None addr None"


# main_first's waves, in-process: each rank's call run in turn against one in-memory store (a real job's ranks
# make the same calls in the same order, so each simulated rank starts the store keys' count afresh)

def _as_rank(monkeypatch: pytest.MonkeyPatch, store: object) -> None:
    import itertools

    import torch.distributed as dist

    from ddptrain.runtime import process_group

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(process_group, "_store_calls", itertools.count())


def _env_of(rank: int, local_rank: int, world_size: int, local_world_size: int, node_rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
                   node_rank=node_rank)


def test_main_first_runs_rank_0_then_each_nodes_first_rank_then_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of two ranks: rank 0 prepares, node 1's first rank (rank 2) prepares its node's cache after it,
    rank 3 only after rank 2; each rank returns its own call's result."""
    import torch.distributed as dist

    from ddptrain.runtime.process_group import main_first

    store = dist.HashStore()
    order: list[int] = []
    for rank, local_rank, node in ((0, 0, 0), (2, 0, 1), (3, 1, 1), (1, 1, 0)):
        _as_rank(monkeypatch, store)
        result = main_first(_env_of(rank, local_rank, 4, 2, node), lambda r=rank: order.append(r) or f"ran {r}",
                            timeout_s=0.5)
        assert result == f"ran {rank}"
    assert order == [0, 2, 3, 1]


def test_main_first_waits_for_its_nodes_first_rank_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.runtime.process_group import main_first

    store = dist.HashStore()
    _as_rank(monkeypatch, store)
    main_first(_env_of(0, 0, 4, 2), lambda: "main", timeout_s=0.5)
    _as_rank(monkeypatch, store)
    ran = []
    with pytest.raises(RuntimeError):  # rank 3: node 1's first rank (rank 2) never ran: the store's wait times out
        main_first(_env_of(3, 1, 4, 2, node_rank=1), lambda: ran.append(3), timeout_s=0.3)
    assert ran == []


def test_a_rank_that_waits_past_the_timeout_for_rank_0_says_so_and_runs_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import main_first

    _as_rank(monkeypatch, dist.HashStore())
    ran = []
    with pytest.raises(ConfigError) as caught:
        main_first(_env_of(1, 1, 2, 2), lambda: ran.append(1), timeout_s=0.3)
    assert str(caught.value) == (
        "data.prepare_timeout_s=0.3: rank 1 waited that long for rank 0 to prepare the data (tokenizing into "
        "data.cache_dir); raise it, or prepare the cache with a one-process run first")
    assert ran == []


def test_rank_0s_error_is_raised_on_the_other_ranks_a_config_error_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import main_first

    def fail(error: Exception) -> None:
        raise error

    store = dist.HashStore()
    for error, raised, message in (
            (ValueError("bad shard"), RuntimeError, "rank 0 failed while preparing: ValueError: bad shard"),
            (ConfigError("data.paths: /nowhere: no such file"), ConfigError, "data.paths: /nowhere: no such file")):
        _as_rank(monkeypatch, store)
        with pytest.raises(type(error)):
            main_first(_env_of(0, 0, 2, 2), lambda e=error: fail(e), timeout_s=0.5)
        _as_rank(monkeypatch, store)
        with pytest.raises(raised) as caught:
            main_first(_env_of(1, 1, 2, 2), lambda: None, timeout_s=0.5)
        assert type(caught.value) is raised and str(caught.value) == message
        store = dist.HashStore()


def test_one_rank_runs_main_first_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.runtime.process_group import main_first

    def no_store() -> None:
        raise AssertionError("a one-rank run has no store to wait on")

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", no_store)
    assert main_first(_env_of(0, 0, 1, 1), lambda: "alone", timeout_s=0.1) == "alone"
