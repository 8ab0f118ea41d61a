"""The uninterrupted one-machine run a multi-process test compares its losses with, trained in forked ranks
(``tests/helpers/dist.py``) instead of through the command.

What those tests guard is the run under test (two agents meeting, pods, replica groups, a restart); the reference
only says which losses the same config gives on one machine. Through the command it paid a launcher and a torch
import per rank (about 17 CPU s for 2 ranks, 31 for 4); forked from the preloaded server it pays the training.
The config is composed from the same override strings as the command's (``compose_config``, the worker's
``validate_config`` and ``Trainer``), so the same seed, data and batch shape; the data comes from ``cache``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers.dist import run_distributed


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str, environ: dict[str, str]) -> dict[str, Any]:
    import os

    import torch

    from ddptrain.app.preflight import validate_config
    from ddptrain.config.compose import compose_config, typed_config
    from ddptrain.ft.layout import data_parallel_size
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import Trainer

    os.environ.update(environ)
    run = typed_config(compose_config(overrides))
    shape = validate_config(run.typed, data_parallel_size(run.typed, world_size))
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    return Trainer(run.typed, env, torch.device("cpu"), Path(run_dir), run.resolved, shape).train()


def reference_losses(overrides: list[str], ranks: int, run_dir: Path, cache: Path,
                     environ: dict[str, str] | None = None) -> tuple[dict[int, float], dict[str, Any]]:
    """Train ``ddptrain <overrides>`` as one machine's ``ranks`` ranks in ``run_dir`` (its data in ``cache``): the
    loss of each logged step (from metrics.jsonl) and rank 0's summary. A ``hydra.run.dir`` among the overrides
    gives way to ``run_dir``. ``environ``: set in each rank (``WANDB_MODE=offline`` for ``logger=wandb``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    args = [*(o for o in overrides if not o.startswith("hydra.run.dir=")), f"launch.nproc_per_node={ranks}",
            f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}"]
    summary = run_distributed(_train, ranks, args, str(run_dir), environ or {})[0]
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}, summary
