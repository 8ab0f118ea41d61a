"""Train through a subclass of the trainer: what a test changes in a step is a method it overrides
(``forward_backward_step``, ``accumulate``), never a module's function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tests.helpers.runs import Overrides, make_config

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


def train_each_with(trainer: type[Trainer], rank: int, world_size: int, tmp: str, base: Overrides,
                    variants: list[Overrides]) -> list[dict]:
    """``runs.train_each`` through ``trainer``: base + each variant on this rank; rank 0 also returns
    metrics.jsonl."""
    from ddptrain.runtime.process_group import DistEnv

    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    results = []
    for i, variant in enumerate(variants):
        run_dir = Path(tmp) / f"w{world_size}-run{i}"
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = trainer(make_config(tmp, base, variant), env, torch.device("cpu"), run_dir, {}).train()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        results.append({"summary": summary, "metrics": [json.loads(line) for line in lines], "dir": str(run_dir)})
    return results
