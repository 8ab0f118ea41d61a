"""One non-finite step on 2 gloo ranks: compressed training drops its error feedback and goes on; fp16 sends a
non-finite loss to train.nan_policy and keeps the loss scaler's back-off for overflows from a finite loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.in_process import train_here
from tests.helpers.runs import train_outcomes

RUN = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 128, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 6, "log_every": 1, "eval_every": 0, "nan_policy": "skip"},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 0},
}
COMPRESSED = {  # name -> (overrides, the step rank 1's loss is poisoned at)
    "topk": ({"parallel": {"compression": "topk"}}, 3),
    # PowerSGD compresses from its second step on: step 4 poisons an error and a warm-start Q that exist
    "powersgd": ({"parallel": {"compression": "powersgd", "powersgd_start_iter": 2}}, 4),
}
FP16 = {"train": {"precision": "fp16"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """name -> per rank: the run's outcome (summary, or the message it ended with) and rank 0's metrics."""
    variants = [(name, overrides, f"nan@step:{step}:1") for name, (overrides, step) in COMPRESSED.items()]
    variants += [
        ("fp16-abort", {"train": {"precision": "fp16", "nan_policy": "abort"}, "checkpoint": {"every_n_steps": 2}},
         "nan@step:3:1"),
        ("fp16-skip", FP16, "nan@step:3:1"),
        ("fp16-overflow-abort", {"train": {"precision": "fp16", "nan_policy": "abort"}}, "overflow@step:3:1"),
    ]
    ranks = run_distributed(train_outcomes, 2, str(tmp_path_factory.mktemp("nonfinite")), RUN, variants, False,
                            timeout=300)
    return {name: [ranks[r][i] for r in (0, 1)] for i, (name, _, _) in enumerate(variants)}


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_one_non_finite_step_costs_compressed_training_one_update_not_the_rest_of_the_run(
    runs: dict, name: str
) -> None:
    bad = COMPRESSED[name][1]
    metrics = runs[name][0]["metrics"]
    norms = {m["step"]: m["grad_norm"] for m in metrics}
    assert math.isnan(norms.pop(bad)) and all(math.isfinite(n) for n in norms.values()), norms
    assert [m["skipped_steps"] for m in metrics] == [0] * (bad - 1) + [1] * (7 - bad)
    assert all(math.isfinite(m["loss"]) for m in metrics if m["step"] != bad)
    assert metrics[-1]["compression_ratio"] < 0.5  # the hook did compress after the bad step
    assert all(rank["summary"] is not None for rank in runs[name])


def test_fp16_abort_ends_a_non_finite_loss_with_one_line_on_every_rank(runs: dict) -> None:
    outcomes = runs["fp16-abort"]
    assert [o["exit_code"] for o in outcomes] == [3, 3]
    assert all(o["error"].startswith("non-finite loss or gradients at step 3 (train.nan_policy=abort)")
               and "\n" not in o["error"] for o in outcomes)
    # the check came before the save of step 4: the latest checkpoint is the one before the bad step
    assert sorted(p.name for p in (Path(outcomes[0]["dir"]) / "checkpoints").iterdir()) == ["step_000002"]


def test_fp16_skip_counts_a_non_finite_loss_as_a_skipped_step_not_a_scaler_back_off(runs: dict) -> None:
    metrics = runs["fp16-skip"][0]["metrics"]
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1, 1]
    assert [m["scaler_backoffs"] for m in metrics] == [0] * 6
    assert all(math.isfinite(m["grad_norm"]) for m in metrics if m["step"] != 3)
    # the scaler's own inf check skipped the update too, and halved the scale (it cannot tell a NaN loss apart)
    assert [m["loss_scale"] for m in metrics] == [65536.0] * 2 + [32768.0] * 4
    assert [r["summary"]["scaler_backoffs"] for r in runs["fp16-skip"]] == [0, 0]


def test_fp16_overflow_from_a_finite_loss_is_only_a_back_off_even_under_abort(runs: dict) -> None:
    outcomes = runs["fp16-overflow-abort"]
    assert [o["error"] for o in outcomes] == [None, None]
    metrics = outcomes[0]["metrics"]
    assert all(math.isfinite(m["loss"]) for m in metrics)  # the loss of step 3 was finite
    assert math.isinf(metrics[2]["grad_norm"]) or math.isnan(metrics[2]["grad_norm"])  # its gradients were not
    assert [m["scaler_backoffs"] for m in metrics] == [0, 0, 1, 1, 1, 1]
    assert [m["skipped_steps"] for m in metrics] == [0] * 6
    assert [m["loss_scale"] for m in metrics] == [65536.0] * 2 + [32768.0] * 4
    assert [(o["summary"]["scaler_backoffs"], o["summary"]["skipped_steps"]) for o in outcomes] == [(1, 0)] * 2


def test_a_poisoned_loss_on_a_rank_in_this_process_aborts_at_the_next_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank in the test process (where mutation testing sees the step's loss guard): the nan fault poisons step
    1's loss; train.nan_policy=abort stops the run at step 2's check (a logging step), naming step 1."""
    ran = train_here(tmp_path, monkeypatch, fault="nan@step:1:0")
    assert ran.exit_code == 3 and ran.error is not None and "step 1" in ran.error, (ran.exit_code, ran.error)
    assert ran.windows == []
