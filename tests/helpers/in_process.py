"""Train one rank in the test process (a one-rank gloo group): mutation testing sees the loop, the step and the
observer here, where the multi-rank runs reach them only in forked ranks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.runs import Overrides, make_config

# a one-layer model on a few synthetic batches: about a second a run on a quiet CPU
ONE_RANK: Overrides = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 64, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 2, "log_every": 2, "eval_every": 0},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 0},
}

# What holds an in-process one-rank group (these trainers, test_compression.py's DDPs), kept until the interpreter
# exits. Freed at the end of a test, a DDP (its reducer holds the process group) runs ~ProcessGroupGloo, which joins
# gloo's worker threads while this thread holds the GIL; a worker may still be releasing the last Python callback of
# a comm hook's future chain (torch's PowerSGD chains several), which needs the GIL: a deadlock (seen in a py-spy
# dump of a hung run). By the time the interpreter exits the workers are idle.
OUTLIVING: list[Any] = []


@dataclass
class Ran:
    """What a one-rank run left: its summary (None when it ended early), the message and exit code it ended with,
    its metrics.jsonl windows and its run directory."""

    run_dir: Path
    summary: dict[str, Any] | None = None
    error: str | None = None
    exit_code: int = 0
    windows: list[dict[str, Any]] = field(default_factory=list)


def train_here(tmp: Path, monkeypatch: pytest.MonkeyPatch, *layers: Overrides, fault: str | None = None) -> Ran:
    """Train ``ONE_RANK`` + ``layers`` on rank 0 of a one-rank world in this process, ``fault`` as DDPTRAIN_FAULT;
    a run that ends early (``RunEnded``) is returned with its message. The summary's traced memory plan is left out
    (``runs.without_the_planned_peak``'s seam, patched for this test only)."""
    import torch.distributed as dist

    from ddptrain.errors import RunEnded
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train import trainer

    monkeypatch.setattr(trainer, "planned_peak", lambda *_: (None, "not traced here (tests/helpers/in_process.py)"))
    if fault is None:
        monkeypatch.delenv("DDPTRAIN_FAULT", raising=False)
    else:
        monkeypatch.setenv("DDPTRAIN_FAULT", fault)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # a fault strikes in a first attempt only
    ran = Ran(tmp)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = trainer.Trainer(make_config(str(tmp), ONE_RANK, *layers), env, torch.device("cpu"), tmp, {})
        OUTLIVING.append(run)
        ran.summary = run.train()
    except RunEnded as exc:
        ran.error, ran.exit_code = str(exc), exc.exit_code
    finally:
        dist.destroy_process_group()
    metrics = tmp / "metrics.jsonl"
    ran.windows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return ran
