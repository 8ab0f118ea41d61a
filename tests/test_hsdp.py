"""HSDP (``parallel.shard_group=node``): 4 processes as 2 nodes x 2 ranks, ZeRO-3 within a node, replicated across.

Same losses as plain ZeRO-3 over all 4 ranks; each rank holds the model state of a shard group of 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.checks import validate_config
from ddptrain.errors import ConfigError
from ddptrain.runtime import DistEnv
from tests.dist import run_distributed
from tests.runs import make_config

BASE = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 16, "global_batch_size": 8,
             "micro_batch_size": 1},
    "train": {"steps": 3, "log_every": 1, "eval_every": 0},
}


def _train_as_two_nodes(rank: int, world_size: int, tmp: str) -> dict[str, dict]:
    from ddptrain.train import train

    env = DistEnv(rank=rank, local_rank=rank % 2, world_size=world_size, local_world_size=2, node_rank=rank // 2)
    out = {}
    for group in ("world", "node"):
        run_dir = Path(tmp) / group
        run_dir.mkdir(exist_ok=True)
        cfg = make_config(tmp, BASE, {"parallel": {"zero_stage": 3, "shard_group": group}})
        summary = train(cfg, env, torch.device("cpu"), run_dir, {})
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        out[group] = {**summary, "losses": [json.loads(line)["loss"] for line in lines]}
    return out


def test_hsdp_matches_zero3_and_holds_a_shard_group_of_two(tmp_path: Path) -> None:
    summaries = run_distributed(_train_as_two_nodes, 4, str(tmp_path), timeout=600)[0]
    zero3, hsdp = summaries["world"], summaries["node"]
    assert len(hsdp["losses"]) == BASE["train"]["steps"]
    assert hsdp["losses"] == pytest.approx(zero3["losses"], rel=1e-4)
    state = hsdp["model_state"]
    assert state["shard_group_size"] == 2 and zero3["model_state"]["shard_group_size"] == 4
    for measured in state["measured_bytes_per_rank"]:
        for component, expected in state["formula_bytes"].items():
            assert measured[component] == pytest.approx(expected, rel=0.05), (component, measured, expected)
    # twice the per-rank state of sharding over all 4 ranks
    assert state["formula_bytes"]["optimizer"] == 2 * zero3["model_state"]["formula_bytes"]["optimizer"]


def test_shard_group_node_needs_a_sharding_stage() -> None:
    with pytest.raises(ConfigError, match=r"parallel.shard_group=node needs parallel.zero_stage=2 or 3"):
        validate_config(make_config("/tmp", {"parallel": {"zero_stage": 1, "shard_group": "node"}}), 2)
