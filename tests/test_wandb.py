"""W&B: rank 0 logs the same metrics as metrics.jsonl with the resolved config; an unreachable W&B never stops a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli

pytestmark = pytest.mark.slow  # every test here runs the real CLI in several processes

# Two logged windows of a small model on short sequences: what is checked is what reaches W&B, not the training (the
# default llama_tiny on 128-token sequences and an 8192-token BPE made this file 47 CPU s, this 37 under load)
TINY = ["logger=wandb", "train.steps=4", "train.log_every=2", "data.max_documents=60", "logger.progress=false",
        "model.num_layers=1", "data.seq_len=32", "data.vocab_size=512", "data.global_batch_size=4",
        "data.micro_batch_size=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenized-data cache for the module's runs (the same data): the tokenizer is trained once."""
    return tmp_path_factory.mktemp("cache")


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the offline W&B run, read back with W&B's own offline reader."""
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(offline)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_offline_wandb_run_holds_the_jsonl_metrics_and_resolved_config(tmp_path: Path, cache: Path) -> None:
    result = run_cli([*TINY, "launch.nproc_per_node=2", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, cache=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [m["step"] for m in jsonl] == [2, 4]
    for logged, written in zip(history, jsonl, strict=True):
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
            assert logged[key] == written[key], key
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["data"]["cache_dir"] == str(cache)  # resolved, not "${oc.env:...}"
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1  # rank 0 only
    # the run's goodput and its breakdown, as summary.json has them, in the W&B run's summary
    updates = [r["summary"]["update"] for r in records if r["type"] == "summary" and "update" in r["summary"]]
    (reported,) = [u for u in updates if "goodput_pct" in u]
    written = json.loads((run_dir / "summary.json").read_text())
    assert reported["goodput_pct"] == pytest.approx(written["goodput_pct"])
    assert reported["goodput"]["startup_pct"] == pytest.approx(written["goodput"]["startup_pct"])


def test_unreachable_wandb_warns_and_the_run_completes(tmp_path: Path, cache: Path) -> None:
    env = {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    result = run_cli([*TINY, "logger.wandb.init_timeout_s=2", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                     cache=cache, extra_env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B unavailable, continuing without it" in result.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
