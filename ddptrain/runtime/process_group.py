"""Process-group lifecycle: ranks and devices from the environment, seeding, the shared run dir, teardown."""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ddptrain.config.choices import Precision, resolve_precision
from ddptrain.config.schema import DistConfig
from ddptrain.diagnose.evidence import enable_flight_recorder
from ddptrain.errors import ConfigError, flat
from ddptrain.runtime import memory_before_groups

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, read from torchrun's environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0  # torchrun's GROUP_RANK: which node (agent) this process runs on

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
            node_rank=int(env.get("GROUP_RANK", "0")),
        )


def pick_device(env: DistEnv) -> torch.device:
    """One device per rank: cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_world_size > count:
        raise ConfigError(
            f"launch: {env.local_world_size} processes on this node but only {count} CUDA devices; "
            f"use --nproc-per-node <= {count}"
        )
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def device_precision(precision: str, device: torch.device) -> Precision:
    """``train.precision`` as this run computes on ``device`` (``resolve_precision``, as the planner resolves it
    for ``plan.device``). bf16 needs compute capability 8 or more: torch's default check also accepts a GPU
    that merely emulates bf16 (a T4 or V100 holds bf16 tensors, slowly), which would plan fp16 and run bf16."""
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return resolve_precision(precision, device.type, bf16)


def pick_backend(cfg: DistConfig, device: torch.device, cpu_collectives: bool = False) -> str:
    """The process group's backend. With ``cpu_collectives`` on CUDA (CPU offload keeps gradient shards and the
    norm that clips them on the CPU) NCCL runs CUDA tensors and gloo CPU ones: ``cuda:nccl,cpu:gloo``."""
    if cfg.backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    elif cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend=nccl needs CUDA devices; use dist.backend=gloo (or auto) on CPU")
    else:
        backend = cfg.backend
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and cpu_collectives else backend


def init_process_group(cfg: DistConfig, env: DistEnv, device: torch.device, cpu_collectives: bool = False) -> None:
    """Join the job's process group (a one-rank group when run in-process) with the configured timeout.

    A one-rank group outside torchrun keeps its store in memory: a TCP store would need a port, and two runs
    started at once on one machine could both be handed the same free one (a port is only free until bound).
    """
    in_process = env.world_size == 1 and "MASTER_ADDR" not in os.environ
    dist.init_process_group(
        backend=pick_backend(cfg, device, cpu_collectives),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
        device_id=device if device.type == "cuda" else None,
        **({"store": dist.HashStore()} if in_process else {}),
    )


def teardown(clean: bool, destroy: bool = True) -> None:
    """Leave the process group, meeting the other ranks first (without it gloo sometimes aborts at exit with
    "terminate called without an active exception").

    After a clean run every rank arrives; after an error a peer may never come, so the barrier is bounded
    (gloo's monitored barrier) or skipped (NCCL), and the elastic agent stops whoever is left.
    """
    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
        elif dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=10))
    except RuntimeError as exc:
        log.warning("ranks did not meet before exit: %s", flat(str(exc), 200))
    if destroy:  # a group a launcher created (Ray Train) is its launcher's to destroy
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every CUDA device too).

    The loop calls it twice: with ``train.seed`` before building the model (identical weights on every rank),
    then with ``train.seed + rank`` for everything random during training (each rank its own dropout masks).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast_from_main(value: T) -> T:
    """Rank 0's value, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_first(env: DistEnv, fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` on rank 0, then on each other node's first rank, then on the rest (which reuse the cache).

    The middle wave prepares a node's own cache when the cache directory is not shared between nodes, so no
    two ranks of a node build it at once. The others wait on the job's key-value store, not in a collective:
    rank 0 tokenizing a large corpus is not a collective timeout (an NCCL watchdog abort), and a wait past
    ``timeout_s`` ends with a message saying so. An error on rank 0 is re-raised on every rank, so no rank
    waits for a peer that quit.
    """
    if env.world_size == 1:
        return fn()
    store = dist.distributed_c10d._get_default_store()
    key = _store_key("main_first")
    if env.is_main:
        result = _publish(store, key, fn, "preparing")
        store.set(f"{key}/node{env.node_rank}", _DONE)  # rank 0 is its own node's first wave
        return result
    _await_main(store, key, timeout_s, (
        f"data.prepare_timeout_s={timeout_s:g}: rank {env.rank} waited that long for rank 0 to prepare the data "
        "(tokenizing into data.cache_dir); raise it, or prepare the cache with a one-process run first"))
    if env.num_nodes == 1:
        return fn()
    node_key = f"{key}/node{env.node_rank}"
    if env.local_rank == 0:
        result = fn()
        store.set(node_key, _DONE)
        return result
    store.wait([node_key], timedelta(seconds=timeout_s))
    return fn()


def main_only(fn: Callable[[], None], timeout_s: float, timeout_key: str, doing: str) -> None:
    """Run ``fn`` on rank 0 alone while the other ranks wait on the job's key-value store, not in a collective.

    For long work of rank 0's at the end of a run (reloading, merging and saving a model of billions of
    parameters): a collective would end it at ``dist.timeout_s`` (an NCCL watchdog abort); the store waits
    ``timeout_s`` (the key ``timeout_key``), then says so in one line. An error on rank 0 is re-raised on every
    rank. ``doing`` names the work in those messages ("exporting the model").
    """
    if dist.get_world_size() == 1:
        fn()
        return
    store = dist.distributed_c10d._get_default_store()
    key = _store_key("main_only")
    if dist.get_rank() == 0:
        _publish(store, key, fn, doing)
        return
    _await_main(store, key, timeout_s, f"{timeout_key}={timeout_s:g}: rank {dist.get_rank()} waited that long "
                                       f"for rank 0, {doing}; raise it")


def _store_key(what: str) -> str:
    """A fresh store key, the same on every rank (each rank makes the same calls in the same order). A restarted
    job may find the keys of its previous attempt in the same store, so the attempt is part of the key."""
    return f"ddptrain/{what}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_store_calls)}"


def _publish(store: dist.Store, key: str, fn: Callable[[], T], doing: str) -> T:
    """Rank 0: run ``fn`` and set ``key`` to done, or to the error that stopped it (then re-raised here)."""
    try:
        result = fn()
    except ConfigError as exc:
        store.set(key, f"{_CONFIG_ERROR}{exc}")
        raise
    except Exception as exc:
        store.set(key, f"rank 0 failed while {doing}: {type(exc).__name__}: {exc}")
        raise
    store.set(key, _DONE)
    return result


def _await_main(store: dist.Store, key: str, timeout_s: float, timed_out: str) -> None:
    """The other ranks: wait up to ``timeout_s`` for rank 0's ``key``; raise its error, or ``timed_out``."""
    deadline = time.monotonic() + timeout_s
    # polled, not store.wait: a native wait sees no Ctrl-C until it returns, and short waits warn at each timeout
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise ConfigError(timed_out)
        time.sleep(0.2)
    status = store.get(key).decode()
    if status.startswith(_CONFIG_ERROR):
        raise ConfigError(status.removeprefix(_CONFIG_ERROR))
    if status != _DONE:
        raise RuntimeError(status)


_store_calls = itertools.count()  # one store key per call, the same sequence on every rank
_DONE, _CONFIG_ERROR = "done", "config error: "


def shared_run_dir(configured: str) -> Path:
    """The run directory chosen by rank 0 (its own clock resolves ``${now:...}``), created and checked."""
    path = Path(broadcast_from_main(str(Path(configured).absolute())))
    error = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{dist.get_rank()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        error = f"hydra.run.dir={path}: cannot write there ({exc.strerror})"
    failed = [error is not None]
    if dist.get_world_size() > 1:
        flags: list[bool] = [False] * dist.get_world_size()
        dist.all_gather_object(flags, failed[0])
        failed = [any(flags)]
    if failed[0]:
        raise ConfigError(error or f"hydra.run.dir={path}: not writable on every rank")
    return path


def apply_debug_level(debug: str) -> None:
    """``dist.debug=info|detail``: torch's distributed debug level, for the process groups created from now on.

    torch reads ``TORCH_DISTRIBUTED_DEBUG`` once, at import; setting the variable later changes nothing until
    ``set_debug_level_from_env()`` reads it again. With detail, each group checks that every rank calls the same
    collective with the same shapes and names the mismatch, instead of hanging or failing obscurely.
    """
    if debug != "off":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug.upper()
        dist.set_debug_level_from_env()


@contextmanager
def distributed(cfg: DistConfig, cpu_collectives: bool = False,
                device: torch.device | None = None) -> Iterator[tuple[DistEnv, torch.device]]:
    """The process group for the duration of a run (``cpu_collectives``: CPU tensors too, on CUDA); always torn
    down, errors included.

    A launcher that creates the group itself (Ray Train's TorchTrainer: its backend, its timeout) hands over a
    process already in it, with ``device`` the one it assigned: the run joins that group, meets the other ranks at
    the end, and leaves destroying it to its owner. torch's debug level and flight recorder act on groups created
    after they are set, so such a launcher sets their variables before it creates the group."""
    joined = dist.is_initialized()
    if not joined:
        apply_debug_level(cfg.debug)
        enable_flight_recorder(cfg.flight_recorder)
    env = DistEnv.from_environ()
    device = device or pick_device(env)
    if not joined:
        memory_before_groups.note(device)  # before NCCL's communicator exists: auto counts it by its allowance
    clean = False
    try:
        if not joined:
            init_process_group(cfg, env, device, cpu_collectives)
        yield env, device
        clean = True
    finally:
        memory_before_groups.forget()
        teardown(clean, destroy=not joined)
