"""Train ``ddptrain <overrides>`` as the command's workers would, in forked ranks (``tests/helpers/dist.py``)
instead of through the command: for a run a test needs but does not guard (an uninterrupted reference, the
checkpoint a refusal needs, the resume after a kill that a CLI run made), and a run with replica groups whose
workers are what a test guards (``train_groups_as_the_command``: each group a world of forked ranks under a torchft
lighthouse in this process; test_ft_cli's drift run, 2 groups of 2 ranks: 18 CPU s at load 10).

Each rank composes the same override strings as the command (``compose_config``), makes the checks the launcher
makes of the run dir before any worker starts (``check_before_start``, ``check_resumable``: read only, so every
rank makes them), and trains through the worker's ``Trainer`` (``app/launch.py``'s ``run_worker``), rank 0
writing the run's ``config.yaml`` and ``train.log``. What it saves, exports and records is the command's, bit for
bit, where the thread count is the same (a forked rank takes one; a CLI run gets one per worker with
``OMP_NUM_THREADS=1``, else its share of the idle cores). A CLI run of 2 ranks costs a launcher and a torch
import per rank (17-25 CPU s here, more the busier the machine); forked from the preloaded server it costs the
training (3-6 CPU s for test_reliability's 5 steps).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tests.helpers.dist import run_distributed


def _as_a_worker(rank: int, world_size: int, overrides: list[str], cache: str, fault: str | None,
                 environ: dict[str, str]) -> dict[str, Any]:
    """One rank: rank 0's log lines (what it logs at info and above) and the run's summary. ``environ`` is set in
    the rank first (``WANDB_MODE=offline`` for ``logger=wandb``)."""
    import logging

    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    import ddptrain
    from ddptrain.app.before_start import check_before_start
    from ddptrain.app.preflight import validate_config
    from ddptrain.checkpoint.before_start import check_resumable
    from ddptrain.config.compose import compose_config, typed_config
    from ddptrain.ft.layout import data_parallel_size, in_group
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.telemetry import setup_logging
    from ddptrain.train.trainer import Trainer

    os.environ.update(environ)
    os.environ["DDPTRAIN_CACHE_DIR"] = cache  # as the command's environment has it (tests/helpers/cli.py)
    os.environ.pop("DDPTRAIN_FAULT", None)
    if fault:
        os.environ["DDPTRAIN_FAULT"] = fault
    ddptrain.ENTERED_AT = time.time()  # goodput: this attempt starts now, as a fresh worker process's would
    run = in_group(typed_config(compose_config(overrides)))  # a replica group's rank: in the group's own dir
    store = _group_store(rank) if run.typed.ft.replica_id is not None else None  # held until the run ends
    shape = validate_config(run.typed, data_parallel_size(run.typed, world_size))
    run_dir = Path(run.cfg.hydra.run.dir).absolute()
    if (resume := check_before_start(run.typed, run_dir)) is not None:
        check_resumable(resume)
    dist.barrier()  # no rank writes before every rank has checked
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(rank, run_dir)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    trainer = Trainer(run.typed, env, torch.device("cpu"), run_dir, run.resolved, shape)
    if env.is_main:  # as run_worker: once the run is known to start
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run.resolved))
    summary = trainer.train()
    del store
    return {"said": "\n".join(said), "summary": summary}


def _group_store(rank: int) -> Any:
    """The store a replica group's torchft Managers meet in, at ``MASTER_ADDR:MASTER_PORT`` (in the command the one
    torchrun's agent hosts for the group's workers): rank 0 hosts it, every rank learns its port."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port[0])
    return store


def _last(args: list[str], key: str, default: str) -> str:
    """The value the command takes for ``key`` from its override strings: the last one given, else ``default``."""
    return next((a.split("=", 1)[1] for a in reversed(args) if a.startswith(f"{key}=")), default)


def train_as_the_command(args: list[str], cache: Path, fault: str | None = None) -> str:
    """Train ``ddptrain <args>`` (``launch.nproc_per_node`` ranks, default 1; ``DDPTRAIN_FAULT=fault``; data cache
    ``cache``) in forked ranks as its workers would; rank 0's log lines. ``hydra.run.dir`` must be among ``args``."""
    ranks = int(_last(args, "launch.nproc_per_node", "1"))
    return run_distributed(_as_a_worker, ranks, list(args), str(cache), fault, {}, timeout=300)[0]["said"]


def train_groups_as_the_command(args: list[str], cache: Path, fault: str | None = None) -> list[str]:
    """Train ``ddptrain <args>`` with replica groups (``ft.replica_groups`` groups of ``launch.nproc_per_node``
    ranks, default 1) as the groups' workers would: each group a world of forked ranks, all at once, under a torchft
    lighthouse in this process set as the command's (``ddptrain/ft/lighthouse.py``). For a check of what the
    workers do inside a group and across groups; the groups' launcher, agents, restarts and the lighthouse's
    process stay with the CLI tests. Each group's rank 0's log lines, in group order."""
    from concurrent.futures import ThreadPoolExecutor

    from torchft.coordination import LighthouseServer

    from ddptrain.ft.lighthouse import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS

    groups, ranks = int(_last(args, "ft.replica_groups", "0")), int(_last(args, "launch.nproc_per_node", "1"))
    server = LighthouseServer(bind="[::]:0", min_replicas=int(_last(args, "ft.min_replicas", "1")),
                              join_timeout_ms=JOIN_TIMEOUT_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    try:
        with ThreadPoolExecutor(groups, thread_name_prefix="group") as pool:
            runs = [pool.submit(run_distributed, _as_a_worker, ranks,
                                [*args, f"ft.replica_id={g}", f"ft.lighthouse={server.address()}"], str(cache), fault,
                                {}, timeout=300) for g in range(groups)]
            return [run.result()[0]["said"] for run in runs]
    finally:
        server.shutdown()


def reference_losses(overrides: list[str], ranks: int, run_dir: Path, cache: Path,
                     environ: dict[str, str] | None = None) -> tuple[dict[int, float], dict[str, Any]]:
    """The uninterrupted one-machine run a multi-process test compares its losses with (the pods, nodes, replica
    groups and Ray workers stay real processes: they are what those tests guard): ``ddptrain <overrides>`` as
    ``ranks`` ranks in ``run_dir`` (a ``hydra.run.dir`` among the overrides gives way to it), its data in
    ``cache``. Returns the loss of each logged step (from metrics.jsonl) and rank 0's summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    args = [*(o for o in overrides if not o.startswith("hydra.run.dir=")), f"launch.nproc_per_node={ranks}",
            f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}"]
    summary = run_distributed(_as_a_worker, ranks, args, str(cache), None, environ or {}, timeout=300)[0]["summary"]
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}, summary
