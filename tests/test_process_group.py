"""The process group a run joins: a one-rank run outside torchrun needs no port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
