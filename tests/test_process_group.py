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


def test_the_environment_of_torchrun_places_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in (("RANK", "5"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "4"),
                       ("GROUP_RANK", "1")):
        monkeypatch.setenv(var, value)
    assert DistEnv.from_environ() == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # one node: the whole world
    assert DistEnv.from_environ().local_world_size == 8
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var)
    assert DistEnv.from_environ() == DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0)


class _FakeDist:
    """torch.distributed's calls teardown, shared_run_dir and init_process_group make, recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, backend: str = "gloo", world_size: int = 2,
                 peer_failed: bool = False, barrier_error: str | None = None) -> None:
        import torch.distributed as dist

        self.calls: list[tuple[str, object]] = []
        self.peer_failed, self.barrier_error, self.world_size = peer_failed, barrier_error, world_size
        for name, fn in (("is_initialized", lambda: True), ("get_backend", lambda: backend),
                         ("get_rank", lambda: 0), ("get_world_size", lambda: world_size),
                         ("barrier", lambda: self.calls.append(("barrier", None))),
                         ("monitored_barrier", self.monitored_barrier),
                         ("destroy_process_group", lambda: self.calls.append(("destroy", None))),
                         ("broadcast_object_list", lambda box, src: self.calls.append(("broadcast", src))),
                         ("all_gather_object", self.all_gather_object),
                         ("init_process_group", lambda **kwargs: self.calls.append(("init", kwargs))),
                         ("set_debug_level_from_env", lambda: self.calls.append(("debug level", None)))):
            monkeypatch.setattr(dist, name, fn)

    def monitored_barrier(self, timeout: object) -> None:
        self.calls.append(("monitored_barrier", timeout))
        if self.barrier_error:
            raise RuntimeError(self.barrier_error)

    def all_gather_object(self, flags: list[object], mine: object) -> None:
        assert len(flags) == self.world_size  # every element is overwritten: its initial value is never read
        flags[:] = [mine] + [self.peer_failed] * (self.world_size - 1)
        self.calls.append(("all_gather", mine))


def test_teardown_meets_the_other_ranks_as_the_run_ended_then_leaves(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from datetime import timedelta

    from ddptrain.runtime.process_group import teardown

    fake = _FakeDist(monkeypatch)
    teardown(True)
    assert fake.calls == [("barrier", None), ("destroy", None)]
    fake.calls.clear()
    teardown(False, destroy=False)  # after an error on gloo: a bounded barrier; a launcher's group is left alone
    assert fake.calls == [("monitored_barrier", timedelta(seconds=10))]
    fake = _FakeDist(monkeypatch, backend="nccl")
    teardown(False)  # NCCL has no bounded barrier: none
    assert fake.calls == [("destroy", None)]
    long = "rank 1 failed to pass monitoredBarrier in 10000 ms\n " + "x" * 300
    fake = _FakeDist(monkeypatch, barrier_error=long)
    with caplog.at_level("WARNING", logger="ddptrain.runtime.process_group"):
        teardown(False)
    assert fake.calls[-1] == ("destroy", None)
    assert [r.getMessage() for r in caplog.records] == [
        "ranks did not meet before exit: " + ("rank 1 failed to pass monitoredBarrier in 10000 ms " + "x" * 300)[:200]]


def test_the_shared_run_dir_is_checked_writable_on_every_rank(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import shared_run_dir

    fake = _FakeDist(monkeypatch)
    assert shared_run_dir(str(tmp_path / "run")) == tmp_path / "run"
    assert (tmp_path / "run").is_dir() and list((tmp_path / "run").iterdir()) == []  # the probe is gone
    assert fake.calls == [("broadcast", 0), ("all_gather", False)]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as caught:  # this rank cannot write: its own reason, told to the others too
        shared_run_dir(str(tmp_path / "file" / "run"))
    assert str(caught.value) == f"hydra.run.dir={tmp_path / 'file' / 'run'}: cannot write there (Not a directory)"
    assert fake.calls[-1] == ("all_gather", True)
    _FakeDist(monkeypatch, peer_failed=True)
    with pytest.raises(ConfigError) as caught:
        shared_run_dir(str(tmp_path / "run"))
    assert str(caught.value) == f"hydra.run.dir={tmp_path / 'run'}: not writable on every rank"
    fake = _FakeDist(monkeypatch, world_size=1)
    assert shared_run_dir(str(tmp_path / "alone")) == tmp_path / "alone"
    assert fake.calls == [("broadcast", 0)]  # one rank gathers nothing


def test_the_process_group_is_joined_with_the_timeout_the_device_and_a_store_only_in_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ddptrain.config.schema import DistConfig
    from ddptrain.runtime.process_group import init_process_group

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    fake = _FakeDist(monkeypatch)
    cuda = torch.device("cuda", 1)
    init_process_group(DistConfig(timeout_s=42), DistEnv(0, 0, 1, 1), torch.device("cpu"))
    init_process_group(DistConfig(), DistEnv(1, 1, 2, 2), cuda)  # torchrun's: no MASTER_ADDR needed to see it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    init_process_group(DistConfig(), DistEnv(0, 0, 1, 1), cuda, cpu_collectives=True)
    (one, two, three) = (kwargs for _, kwargs in fake.calls)
    assert isinstance(one.pop("store"), dist.HashStore)  # a one-rank run outside torchrun: no port
    assert one == {"backend": "gloo", "rank": 0, "world_size": 1, "timeout": timedelta(seconds=42), "device_id": None}
    assert two == {"backend": "nccl", "rank": 1, "world_size": 2, "timeout": timedelta(seconds=300),
                   "device_id": cuda}
    assert three == {"backend": "cuda:nccl,cpu:gloo", "rank": 0, "world_size": 1, "timeout": timedelta(seconds=300),
                     "device_id": cuda}


def test_the_backend_follows_the_device_and_nccl_is_refused_on_the_cpu() -> None:
    import torch

    from ddptrain.config.schema import DistConfig
    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import pick_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert pick_backend(DistConfig(backend="gloo"), cpu) == "gloo"
    assert pick_backend(DistConfig(backend="gloo"), cuda, cpu_collectives=True) == "gloo"
    assert pick_backend(DistConfig(backend="nccl"), cuda) == "nccl"
    assert pick_backend(DistConfig(backend="nccl"), cuda, cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    with pytest.raises(ConfigError) as caught:
        pick_backend(DistConfig(backend="nccl"), cpu)
    assert str(caught.value) == "dist.backend=nccl needs CUDA devices; use dist.backend=gloo (or auto) on CPU"


def test_the_debug_level_is_set_for_torch_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddptrain.runtime.process_group import apply_debug_level

    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "")  # recorded, so the variable apply_debug_level sets is undone
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    fake = _FakeDist(monkeypatch)
    apply_debug_level("off")
    assert "TORCH_DISTRIBUTED_DEBUG" not in os.environ and fake.calls == []
    apply_debug_level("detail")
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and fake.calls == [("debug level", None)]


def test_main_only_runs_on_rank_0_while_the_others_wait_on_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import main_only

    store, ran = dist.HashStore(), []
    _as_rank(monkeypatch, store)
    fake = _FakeDist(monkeypatch, world_size=1)
    main_only(lambda: ran.append("alone"), 0.1, "checkpoint.export_timeout_s", "exporting the model")
    assert ran == ["alone"] and fake.calls == []
    for rank in (1, 0, 1):  # rank 1 first: rank 0 has not finished, it gives up; then after rank 0 it goes on
        _as_rank(monkeypatch, store)
        _FakeDist(monkeypatch)
        monkeypatch.setattr(dist, "get_rank", lambda r=rank: r)
        if rank == 1 and not ran[1:]:
            with pytest.raises(ConfigError) as caught:
                main_only(lambda: ran.append("rank 1"), 0.3, "checkpoint.export_timeout_s", "exporting the model")
            assert str(caught.value) == ("checkpoint.export_timeout_s=0.3: rank 1 waited that long for rank 0, "
                                         "exporting the model; raise it")
        else:
            main_only(lambda r=rank: ran.append(f"rank {r}"), 0.3, "checkpoint.export_timeout_s",
                      "exporting the model")
    assert ran == ["alone", "rank 0"]  # rank 1 ran nothing: the work is rank 0's alone


def test_main_onlys_error_on_rank_0_is_raised_on_the_others_naming_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.runtime.process_group import main_only

    def fail() -> None:
        raise OSError("disk full")

    store = dist.HashStore()
    for rank in (0, 1):
        _as_rank(monkeypatch, store)
        _FakeDist(monkeypatch)
        monkeypatch.setattr(dist, "get_rank", lambda r=rank: r)
        with pytest.raises((OSError, RuntimeError)) as caught:
            main_only(fail, 0.3, "checkpoint.export_timeout_s", "exporting the model")
        assert str(caught.value) == ("disk full" if rank == 0 else
                                     "rank 0 failed while exporting the model: OSError: disk full")


def test_a_restarted_attempt_does_not_take_the_previous_attempts_keys_for_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The elastic agent restarts the ranks with the same store: attempt 1's rank 1 must wait for attempt 1's rank
    0, not read attempt 0's "done"."""
    import torch.distributed as dist

    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import main_first

    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _as_rank(monkeypatch, store)
    main_first(_env_of(0, 0, 2, 2), lambda: None, timeout_s=0.3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _as_rank(monkeypatch, store)
    with pytest.raises(ConfigError, match="rank 1 waited that long"):
        main_first(_env_of(1, 1, 2, 2), lambda: None, timeout_s=0.3)
    _as_rank(monkeypatch, store)  # attempt 1's rank 0, twice: each call of rank 1 waits for its own call's key
    for _ in range(2):
        main_first(_env_of(0, 0, 2, 2), lambda: None, timeout_s=0.3)
    _as_rank(monkeypatch, store)
    assert [main_first(_env_of(1, 1, 2, 2), lambda n=n: n, timeout_s=0.3) for n in range(2)] == [0, 1]
    with pytest.raises(ConfigError, match="rank 1 waited that long"):
        main_first(_env_of(1, 1, 2, 2), lambda: None, timeout_s=0.3)


def test_seed_everything_seeds_pythons_numpys_and_torchs_generators() -> None:
    """The same seed gives the same draws from all three generators; another seed other draws from each."""
    import random

    import numpy as np
    import torch

    from ddptrain.runtime.process_group import seed_everything

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        seed_everything(3)
        first = draws()
        seed_everything(3)
        assert draws() == first
        seed_everything(4)
        assert all(a != b for a, b in zip(draws(), first, strict=True))
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def test_broadcast_from_main_returns_rank_0s_value(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from ddptrain.runtime.process_group import broadcast_from_main

    sources: list[object] = []

    def broadcast(box: list[object], src: object = None) -> None:
        sources.append(src)
        box[0] = "rank 0's"

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    assert broadcast_from_main("mine") == "rank 0's" and sources == [0]
