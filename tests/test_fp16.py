"""fp16 mixed precision (train.precision=fp16): autocast fp16 with a loss scaler, an overflow (non-finite gradients
from a finite loss) skipped on every rank as a back-off of the scale, and the scale resumed exactly. A non-finite
loss is train.nan_policy's (tests/test_nonfinite.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddptrain.train.components import autocast_context
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_outcomes

RUN = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 1, "eval_every": 0, "precision": "fp16", "nan_policy": "abort"},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 2, "export": True},
}


def test_fp16_autocast_computes_matmuls_in_half_precision() -> None:
    a = torch.randn(4, 4)
    with autocast_context("fp16", torch.device("cpu")):
        assert (a @ a).dtype == torch.float16
    with autocast_context("fp32", torch.device("cpu")):
        assert (a @ a).dtype == torch.float32


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[dict]], Path]:
    """Two ranks, rank 1's gradients overflowing fp16 at step 1 from a finite loss: DDP straight, DDP resumed from
    step 2, ZeRO-2, fp32 skipping the same step (a poisoned loss, train.nan_policy=skip) for reference, and
    ZeRO-1."""
    tmp = tmp_path_factory.mktemp("fp16")
    overflow = "overflow@step:1:1"
    variants = [
        ("w2-run0", {}, overflow),
        ("w2-run1", {"train": {"resume": str(tmp / "w2-run0" / "checkpoints" / "step_000002")}}, overflow),
        ("w2-run2", {"parallel": {"zero_stage": 2}}, overflow),
        ("w2-run3", {"train": {"precision": "fp32", "nan_policy": "skip"}}, "nan@step:1:1"),
        ("w2-run4", {"parallel": {"zero_stage": 1}}, overflow),
    ]
    return run_distributed(train_outcomes, 2, str(tmp), RUN, variants, timeout=300), tmp


def test_fp16_skips_an_injected_overflow_on_both_ranks_as_a_scaler_back_off(fp16_runs: tuple) -> None:
    ranks, _ = fp16_runs
    for run in (0, 2, 4):  # torch DDP and ZeRO-1 (GradScaler), ZeRO-2 (ShardedGradScaler)
        metrics = ranks[0][run]["metrics"]
        # nan_policy=abort did not fire: the overflow is the scaler's back-off, 65536 -> 32768, then steps go on
        assert [m["loss_scale"] for m in metrics] == [32768.0] * 4, run
        assert [m["scaler_backoffs"] for m in metrics] == [1] * 4 and metrics[-1]["skipped_steps"] == 0
        # fp16 trains the fp32 run's model to fp16's rounding, and did compute in fp16 (not bitwise equal)
        fp32 = [m["loss"] for m in ranks[0][3]["metrics"]]
        # (step 1's mean loss is finite in fp16, the poisoned NaN in fp32)
        assert math.isfinite(metrics[0]["loss"]) and math.isnan(ranks[0][3]["metrics"][0]["loss"])
        assert [m["loss"] for m in metrics[1:]] == pytest.approx(fp32[1:], abs=5e-3) and metrics[-1]["loss"] != fp32[-1]
        summaries = [ranks[r][run]["summary"] for r in (0, 1)]
        assert [(s["loss_scale"], s["scaler_backoffs"]) for s in summaries] == [(32768.0, 1)] * 2, run


def test_fp16_resume_continues_the_scale_and_the_weights_bitwise(fp16_runs: tuple) -> None:
    ranks, tmp = fp16_runs
    straight, resumed = ranks[0][0]["metrics"], ranks[0][1]["metrics"]
    assert [m["step"] for m in resumed] == [3, 4]
    assert [(m["loss"], m["loss_scale"], m["scaler_backoffs"]) for m in resumed] == \
        [(m["loss"], m["loss_scale"], m["scaler_backoffs"]) for m in straight[2:]]
    a, b = (load_file(tmp / f"w2-run{i}" / "model" / "model.safetensors") for i in (0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
