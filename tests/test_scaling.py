"""The scaling sweep runs the real launcher at N = 1, 2 and writes its table, CSV and plot; a failed size is named."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import procs
from tests.helpers.run_cache import RunCache

REPO = Path(__file__).parents[1]

pytestmark = pytest.mark.slow  # every test here runs the real CLI in several processes
# no export: the sweep reads each run's summary.json, never its save_pretrained model
TINY = ["data.max_documents=60", "train.steps=6", "train.log_every=2", "train.eval_every=0",
        "data.micro_batch_size=2", "model.num_layers=1", "logger.progress=false", "checkpoint.export=false"]


@pytest.fixture
def cache(cli_runs: RunCache) -> Path:
    """The session's data cache (``tests/helpers/run_cache.py``): the tokenizer and tokens of these 60 documents
    are prepared once for both sweeps and the other CLI runs on them (``conftest.torchrun_run``)."""
    return cli_runs.data_cache


def sweep(args: list[str], tmp_path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DDPTRAIN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    return procs.run([sys.executable, str(REPO / "scripts" / "scaling.py"), *args], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_weak_sweep_writes_table_csv_plot_and_wandb_run(tmp_path: Path, cache: Path) -> None:
    result = sweep(["--sizes", "1", "2", "--out", "docs", "--runs", "runs", "--wandb", "--",
                    *TINY, "data.global_batch_size=4", "metrics.peak_tflops=1"], tmp_path, cache)
    assert result.returncode == 0, result.stderr[-3000:]
    docs = tmp_path / "docs"
    rows = list(csv.DictReader((docs / "scaling.csv").open()))
    assert [int(r["world_size"]) for r in rows] == [1, 2]
    assert [int(r["global_batch_size"]) for r in rows] == [4, 8]  # weak: the work per rank is held fixed
    for row in rows:
        assert float(row["tokens_per_s"]) > 0 and float(row["efficiency"]) > 0, row
        assert 0 < float(row["mfu_pct"]) <= 100, row  # a known peak gives the MFU column
    one, two = rows
    # by construction, not by the machine's speed (two runs at different moments of a busy machine gave 1.37):
    # speed-up against N=1, efficiency the speed-up per rank
    speedup = float(two["tokens_per_s"]) / float(one["tokens_per_s"])
    assert float(one["speedup"]) == pytest.approx(1.0) and float(one["efficiency"]) == pytest.approx(1.0)
    assert float(two["speedup"]) == pytest.approx(speedup) and float(two["efficiency"]) == pytest.approx(speedup / 2)
    for key in ("time_exposed_comm_s", "comm_time_s"):  # N=1 trains the bare model: nothing to communicate
        assert one[key] == "" and float(two[key]) > 0, (key, one, two)
    md = (docs / "scaling.md").read_text()
    assert "| 2 | 8 |" in md and "scripts/scaling.py --sizes 1 2" in md and "Weak scaling" in md
    assert (docs / "scaling.png").stat().st_size > 10_000
    assert len(list((tmp_path / "runs" / "wandb").glob("offline-run-*"))) == 1


def test_a_failed_size_is_reported_and_the_others_are_still_written(tmp_path: Path, cache: Path) -> None:
    # strong scaling holds the global batch at 2: one micro-batch of 2 at N=1, impossible at N=2
    result = sweep(["--sizes", "1", "2", "--mode", "strong", "--out", "docs", "--runs", "runs", "--",
                    *TINY, "data.global_batch_size=2"], tmp_path, cache)
    assert result.returncode == 1
    assert "N=2 failed" in result.stderr and "global_batch_size" in result.stderr.split("N=2 failed")[1]
    rows = list(csv.DictReader((tmp_path / "docs" / "scaling.csv").open()))
    assert [int(r["world_size"]) for r in rows] == [1]
    assert "Failed runs (left out above): N=2" in (tmp_path / "docs" / "scaling.md").read_text()
