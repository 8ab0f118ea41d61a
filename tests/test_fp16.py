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
from tests.helpers.in_process import train_here
from tests.helpers.runs import train_each, train_outcomes

RUN = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 1, "eval_every": 0, "precision": "fp16", "nan_policy": "abort"},
    "optim": {"lr": 1e-2, "warmup_steps": 0, "grad_clip": 0.5},  # clipping acts on every step
    "checkpoint": {"every_n_steps": 2, "export": True},
}


def test_fp16_autocast_computes_matmuls_in_half_precision() -> None:
    a = torch.randn(4, 4)
    with autocast_context("fp16", torch.device("cpu")):
        assert (a @ a).dtype == torch.float16
    with autocast_context("fp32", torch.device("cpu")):
        assert (a @ a).dtype == torch.float32


def _train_with_an_overflow_in_one_shard(rank: int, world_size: int, tmp: str, base: dict, variants: list) -> list:
    """``train_each`` with one value of rank 1's gradient shard made infinite at step 1, after the gradient sync
    and before the scaler's unscale: an overflow only rank 1 can see in its own shard."""
    from torch.distributed.tensor import DTensor

    from ddptrain.train.loss_scale import LossScaler

    unscale, steps = LossScaler.unscale, [0]

    def overflowing(self: LossScaler, optimizer: torch.optim.Optimizer) -> None:
        steps[0] += 1
        if steps[0] == 1 and rank == 1:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            assert isinstance(grad, DTensor)  # ZeRO-2: each rank holds its shard of the gradient
            grad.to_local().view(-1)[0] = float("inf")
        unscale(self, optimizer)

    LossScaler.unscale = overflowing  # type: ignore[method-assign]  # this forked rank only
    return train_each(rank, world_size, tmp, base, variants)


def test_zero2_fp16_an_overflow_in_one_ranks_shard_backs_off_every_ranks_scale(tmp_path: Path) -> None:
    """ZeRO-2 shards the gradients: the scaler's inf check must be all-reduced over the shards (torch's
    ShardedGradScaler), or only the rank whose shard overflowed halves its scale and the ranks' scales part."""
    run = {**RUN, "train": {**RUN["train"], "steps": 2}, "checkpoint": {"export": False}}
    ranks = run_distributed(_train_with_an_overflow_in_one_shard, 2, str(tmp_path), run,
                            [{"parallel": {"zero_stage": 2}}], timeout=300)
    for r in (0, 1):
        (result,) = ranks[r]
        assert (result["summary"]["loss_scale"], result["summary"]["scaler_backoffs"]) == (32768.0, 1), r
    metrics = ranks[0][0]["metrics"]
    assert [(m["loss_scale"], m["scaler_backoffs"], m["skipped_steps"]) for m in metrics] == [(32768.0, 1, 0)] * 2
    assert metrics[0]["grad_norm"] == float("inf")  # the overflow was seen (in the norm over all shards)


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


def test_fp16_logs_the_unscaled_gradient_norm_of_the_fp32_run(fp16_runs: tuple) -> None:
    """Step 1 is skipped in both runs, so step 2 starts from the same weights on the same batch: its gradient norm
    in fp16 (scaled by 32768, unscaled before the norm and the clip) equals fp32's to fp16's rounding. The norm is
    above optim.grad_clip=0.5, so the clip acted: clipping the still-scaled gradients would log a norm 32768 times
    larger."""
    ranks, _ = fp16_runs
    fp16, fp32 = ([m["grad_norm"] for m in ranks[0][run]["metrics"]] for run in (0, 3))
    assert fp32[1] > 0.5  # clipping active
    assert fp16[1] == pytest.approx(fp32[1], rel=2**-10)  # fp16 rounding (measured: 1.4e-5)
    assert fp16[2:] == pytest.approx(fp32[2:], rel=1e-2)  # later: weights apart by fp16's rounding (1e-3)


def test_an_injected_overflow_on_a_rank_in_this_process_is_one_scaler_back_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank in the test process (where mutation testing sees the step's loss scaling): the overflow fault scales
    step 1's backward past fp16's range, the scaler backs off once (65536 -> 32768) and nothing is skipped as a
    nan_policy event."""
    ran = train_here(tmp_path, monkeypatch, {"train": {"precision": "fp16"}}, fault="overflow@step:1:0")
    assert ran.error is None
    assert [(w["loss_scale"], w["scaler_backoffs"], w["skipped_steps"]) for w in ran.windows] == [(32768.0, 1, 0)]
