"""ZeRO stages 1-3 and compression, through the real loop: same gradients, same losses, memory as the formula says."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from ddptrain.app.preflight import validate_config
from ddptrain.config.compose import build_config
from ddptrain.config.schema import ModelConfig, ParallelConfig
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.parallel import wrap_model
from ddptrain.step.compute import accumulate_gradients
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each

VOCAB, SEQ, B = 256, 16, 4
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, max_position_embeddings=64)


def _batch(world_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (world_size * B, SEQ), generator=torch.Generator().manual_seed(7))


def _grads_per_stage(rank: int, world_size: int) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = build_model(TINY, VOCAB, eos_id=0)
        wrapped = wrap_model(model, ParallelConfig(zero_stage=stage), torch.device("cpu"))
        shard = _batch(world_size)[rank * B : (rank + 1) * B]
        accumulate_gradients(wrapped.outer, iter(shard.chunk(2)), 2, wrapped.maybe_sync, nullcontext())
        out[stage] = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()
        }
    return out


def test_every_stage_gives_the_single_process_gradients_with_accumulation() -> None:
    torch.manual_seed(0)
    reference = build_model(TINY, VOCAB, eos_id=0)
    ids = _batch(2)
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for rank, per_stage in enumerate(run_distributed(_grads_per_stage, 2)):
        for stage, grads in per_stage.items():
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} stage {stage} {name}")


BASE = {
    "model": {"hidden_size": 64, "num_layers": 4, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 512, "num_samples": 256, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 5, "log_every": 1, "eval_every": 0},
}


def test_each_stage_tracks_stage_zero_and_memory_follows_the_formula_at_two_ranks(tmp_path: Path) -> None:
    variants = [{"parallel": {"zero_stage": s}} for s in (0, 1, 2, 3)]
    bf16 = {"parallel": {"zero_stage": 3}, "train": {"precision": "bf16"}}  # FSDP2's bf16 policy, on CPU too
    *results, mixed = run_distributed(train_each, 2, str(tmp_path), BASE, [*variants, bf16])[0]
    base = [m["loss"] for m in results[0]["metrics"]]
    assert base[-1] < base[0]
    for stage, result in enumerate(results):
        losses = [m["loss"] for m in result["metrics"]]
        # Same data, same init, same math; only the reduction order differs: agree to float32 noise.
        assert losses == pytest.approx(base, rel=1e-4), f"stage {stage}"
        _assert_memory_matches_formula(result["summary"]["model_state"], stage)
    state = mixed["summary"]["model_state"]
    _assert_memory_matches_formula(state, 3)
    for held in state["measured_bytes_by_dtype_per_rank"]:  # the fp32 shards and the gathered bf16 copy
        assert held["parameters"].keys() == {"float32", "bfloat16"}
        assert held["parameters"] == pytest.approx(state["formula_bytes_by_dtype"]["parameters"], rel=0.05)


def test_memory_follows_the_formula_at_four_ranks(tmp_path: Path) -> None:
    # The loop measures the model state once, after the first step: one step per stage is enough here.
    variants = [{"parallel": {"zero_stage": s}, "train": {"steps": 1}} for s in (0, 1, 2, 3)]
    for stage, result in enumerate(run_distributed(train_each, 4, str(tmp_path), BASE, variants)[0]):
        _assert_memory_matches_formula(result["summary"]["model_state"], stage)


def _assert_memory_matches_formula(state: dict, stage: int) -> None:
    assert state["zero_stage"] == stage
    for rank, held in enumerate(state["measured_bytes_per_rank"]):
        for component, expected in state["formula_bytes"].items():
            assert held[component] == pytest.approx(expected, rel=0.05), (stage, rank, component, held, expected)


def test_compression_bytes_are_logged_through_the_loop(tmp_path: Path) -> None:
    variants = [{"parallel": {"compression": c}} for c in ("none", "fp16")]
    variants.append({"parallel": {"compression": "topk", "topk_ratio": 0.01}})
    none, fp16, topk = (r["metrics"] for r in run_distributed(train_each, 2, str(tmp_path), BASE, variants)[0])
    assert all(m["compression_ratio"] == 1.0 for m in none)
    assert len(fp16) == len(none) == 5
    assert all(m["compression_ratio"] == 0.5 for m in fp16)
    assert all(m["comm_bytes"] * 2 == n["comm_bytes"] for m, n in zip(fp16, none, strict=True))
    assert all(m["compression_ratio"] <= 0.04 for m in topk)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"zero_stage": 4}, "parallel.zero_stage=4: expected 0, 1, 2 or 3"),
        ({"zero_stage": 2, "compression": "fp16"},
         "parallel.compression=fp16 cannot be combined with parallel.zero_stage=2"),
        ({"cpu_offload": True, "zero_stage": 2}, "parallel.cpu_offload=true needs parallel.zero_stage=3"),
        ({"compression": "powersgd", "powersgd_start_iter": 1}, "parallel.powersgd_start_iter=1"),
        ({"compression": "zip"}, "parallel.compression"),
        ({"collective": "ring"}, "parallel.collective=ring needs a from-scratch parallel.engine"),
    ],
)
def test_strategy_combinations_that_make_no_sense_fail_at_start_up(parallel: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):  # the schema refuses them, at composition
        validate_config(build_config({"parallel": parallel}), world_size=2)
