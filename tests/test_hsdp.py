"""HSDP (``parallel.shard_group=node``): 4 processes as 2 nodes x 2 ranks, ZeRO-3 within a node, replicated across.

Same losses as plain ZeRO-3 over all 4 ranks; each rank holds the model state of a shard group of 2. A run resumed
from an HSDP checkpoint continues bitwise as the uninterrupted one, and the same checkpoint (DCP, keyed by
parameter name, whatever the mesh) resumes under plain ZeRO-3 and DDP, on the same 4 ranks and on 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.app.preflight import validate_config
from ddptrain.checkpoint import offline
from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import DistEnv
from tests.helpers.dist import run_distributed
from tests.helpers.runs import Overrides, make_config, train_each, without_the_planned_peak
from tests.helpers.tiny import TINY_MODEL

BASE: Overrides = {
    "model": TINY_MODEL,
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 16, "global_batch_size": 8,
             "micro_batch_size": 1},
    "train": {"steps": 3, "log_every": 1, "eval_every": 0},
}
HSDP: Overrides = {"parallel": {"zero_stage": 3, "shard_group": "node"}, "checkpoint": {"every_n_steps": 2}}
SAVED_AT = 2  # the HSDP run saves at step 2 (and 3, its last); resumed runs train step 3 from step 2's checkpoint


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _train_as_two_nodes(rank: int, world_size: int, tmp: str) -> dict[str, dict]:
    """ZeRO-3 over all ranks; HSDP saving checkpoints; then from the latter's step-2 checkpoint: HSDP, ZeRO-3 over
    all ranks (a 1-D mesh instead of 2 x 2) and DDP."""
    from ddptrain.train.trainer import train

    without_the_planned_peak()  # nothing here reads it
    env = DistEnv(rank=rank, local_rank=rank % 2, world_size=world_size, local_world_size=2, node_rank=rank // 2)
    resume = {"train": {"resume": str(_checkpoint(Path(tmp) / "node", SAVED_AT))}}
    runs: dict[str, Overrides] = {
        "world": {"parallel": {"zero_stage": 3, "shard_group": "world"}},
        "node": HSDP,
        "node_resumed": {**HSDP, **resume},
        "zero3_resumed": {"parallel": {"zero_stage": 3}, **resume},
        "ddp_resumed": resume,
    }
    out = {}
    for name, overrides in runs.items():
        run_dir = Path(tmp) / name
        run_dir.mkdir(exist_ok=True)
        summary = train(make_config(tmp, BASE, overrides), env, torch.device("cpu"), run_dir, {})
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        out[name] = {**summary, "losses": [json.loads(line)["loss"] for line in lines], "dir": run_dir}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_distributed(_train_as_two_nodes, 4, str(tmp_path_factory.mktemp("hsdp")), timeout=600)[0]


def test_hsdp_matches_zero3_and_holds_a_shard_group_of_two(runs: dict[str, dict[str, Any]]) -> None:
    zero3, hsdp = runs["world"], runs["node"]
    assert len(hsdp["losses"]) == BASE["train"]["steps"]
    assert hsdp["losses"] == pytest.approx(zero3["losses"], rel=1e-4)
    state = hsdp["model_state"]
    assert state["shard_group_size"] == 2 and zero3["model_state"]["shard_group_size"] == 4
    for measured in state["measured_bytes_per_rank"]:
        for component, expected in state["formula_bytes"].items():
            assert measured[component] == pytest.approx(expected, rel=0.05), (component, measured, expected)
    # twice the per-rank state of sharding over all 4 ranks
    assert state["formula_bytes"]["optimizer"] == 2 * zero3["model_state"]["formula_bytes"]["optimizer"]


def test_hsdp_resume_is_bitwise_the_uninterrupted_run(runs: dict[str, dict[str, Any]]) -> None:
    # Same world, mesh and data position, and every rank's RNG restored: nothing may differ, not even in the last bit.
    uninterrupted, resumed = runs["node"], runs["node_resumed"]
    assert resumed["losses"] == uninterrupted["losses"][SAVED_AT:]
    last = [_checkpoint(run["dir"], BASE["train"]["steps"]) for run in (uninterrupted, resumed)]
    keys = list(offline.tensor_entries(last[0]))
    assert keys and keys == list(offline.tensor_entries(last[1]))
    straight, again = (offline.read_tensors(c, keys) for c in last)
    assert [k for k in keys if not torch.equal(straight[k], again[k])] == []


def _assert_step_3_as_uninterrupted(loss: float, uninterrupted: list[float], case: str) -> None:
    # Step 3's loss (before its update) from step 2's weights on the same global batch; only the reduction order
    # differs (other shards, other micro-batches per rank): float32 noise, the checkpoint tests' tolerance.
    assert loss == pytest.approx(uninterrupted[SAVED_AT], rel=1e-5), case


def test_an_hsdp_checkpoint_resumes_under_zero3_and_ddp(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("zero3_resumed", "ddp_resumed"):
        (loss,) = runs[name]["losses"]
        _assert_step_3_as_uninterrupted(loss, runs["node"]["losses"], name)


def test_an_hsdp_checkpoint_resumes_under_zero3_and_ddp_on_two_ranks(
    runs: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    checkpoint = str(_checkpoint(runs["node"]["dir"], SAVED_AT))
    variants: list[Overrides] = [{"parallel": {"zero_stage": 3}, "train": {"resume": checkpoint}},
                                 {"train": {"resume": checkpoint}}]
    for variant, result in zip(variants, run_distributed(train_each, 2, str(tmp_path), BASE, variants)[0],
                               strict=True):
        (loss,) = [m["loss"] for m in result["metrics"]]
        _assert_step_3_as_uninterrupted(loss, runs["node"]["losses"], str(variant))


def test_shard_group_node_needs_a_sharding_stage() -> None:
    with pytest.raises(ConfigError, match=r"parallel.shard_group=node needs parallel.zero_stage=2 or 3"):
        validate_config(make_config("/tmp", {"parallel": {"zero_stage": 1, "shard_group": "node"}}), 2)


# not torch's default (1,800 s on gloo), and long enough for four ranks to connect their groups on a busy machine:
# at 7 s, one rank's connect timed out at load 6 on 2 cores ("Gloo connectFullMesh failed ... Connection closed by
# peer")
MESH_TIMEOUT_S = 240


def _mesh_groups(rank: int, world_size: int) -> list[tuple[str, list[int], str, float]]:
    from datetime import timedelta

    import torch.distributed as dist

    from ddptrain.parallel.zero import hybrid_mesh

    mesh = hybrid_mesh(torch.device("cpu"), 2, timedelta(seconds=MESH_TIMEOUT_S))
    out = []
    for dim in ("replicate", "shard"):
        group = mesh.get_group(dim)
        timeout = group._get_backend(torch.device("cpu")).options._timeout  # no public getter; gloo's own options
        out.append((dim, dist.get_process_group_ranks(group), group.group_desc, timeout.total_seconds()))
    return out


def test_the_hsdp_meshs_groups_time_out_at_dist_timeout_s_not_torchs_default() -> None:
    """A hang inside FSDP2's all-gather sits on a mesh group: built by init_device_mesh it would wait torch's
    default (30 minutes on gloo, 10 on NCCL) instead of dist.timeout_s."""
    for rank, groups in enumerate(run_distributed(_mesh_groups, 4)):
        assert groups == [("replicate", [rank % 2, rank % 2 + 2], "mesh_replicate", MESH_TIMEOUT_S),
                          ("shard", [rank - rank % 2, rank - rank % 2 + 1], "mesh_shard", MESH_TIMEOUT_S)], \
            (rank, groups)
