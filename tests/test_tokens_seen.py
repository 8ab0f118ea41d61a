"""``tokens_seen``: the real tokens every rank trained on since step 1, in each metrics record and summary.json.

A resumed run continues the count of the run it resumes (fixed blocks and prompt/completion rows alike), a step
left out of a logging window (the CPU memory tracker's) still counts, and a checkpoint saved before the count was
recorded derives it from its data position. The summary's named losses of a straight and a resumed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddptrain.data import build_token_data
from tests.helpers.dist import run_distributed
from tests.helpers.runs import make_config, train_each, without_token_count
from tests.helpers.tiny import TINY_MODEL

SEQ_LEN, GBS = 32, 8
BLOCKS = {
    "model": TINY_MODEL,
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": SEQ_LEN,
             "global_batch_size": GBS, "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 1, "eval_every": 0},
    "checkpoint": {"every_n_steps": 2},
}


def _seen(run: dict) -> list[int]:
    return [m["tokens_seen"] for m in run["metrics"]]


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """2 ranks: 4 steps straight (a checkpoint at step 2); steps 3-4 resumed from it; 3 steps logged once."""
    tmp = tmp_path_factory.mktemp("blocks")
    resumed = {"train": {"resume": str(tmp / "w2-run0" / "checkpoints" / "step_000002")}}
    # log_every=3: step 2, the CPU memory tracker's (slowed by a hook per op), is left out of the window's timing
    window = {"train": {"steps": 3, "log_every": 3}, "checkpoint": {"every_n_steps": 0}}
    return run_distributed(train_each, 2, str(tmp), BLOCKS, [{}, resumed, window])[0]


def test_a_resumed_fixed_block_run_continues_the_token_count(block_runs: list[dict]) -> None:
    straight, resumed, _ = block_runs
    assert _seen(straight) == [GBS * SEQ_LEN * step for step in (1, 2, 3, 4)]
    assert _seen(resumed) == _seen(straight)[2:]
    assert resumed["summary"]["tokens_seen"] == straight["summary"]["tokens_seen"] == 4 * GBS * SEQ_LEN


def test_a_resumed_runs_summary_has_no_step_one_loss_and_names_its_own_first_logged_step(
    block_runs: list[dict],
) -> None:
    """summary.json's losses by their steps (2 ranks, a window every step): the straight run's step-1 loss is the
    ranks' mean, as metrics.jsonl's line for step 1 has it; the run resumed after step 2 trained no step 1 (null)
    and logged first at step 3, not at train.log_every."""
    straight, resumed, _ = block_runs
    first, again = straight["metrics"][0], resumed["metrics"][0]
    assert (first["step"], again["step"]) == (1, 3)
    assert [straight["summary"][k] for k in ("first_step_loss", "first_logged_step", "first_logged_loss")] == [
        first["loss"], 1, first["loss"]]
    assert [resumed["summary"][k] for k in ("first_step_loss", "first_logged_step", "first_logged_loss")] == [
        None, 3, again["loss"]]


def test_the_memory_tracker_step_left_out_of_a_window_still_counts_in_tokens_seen(block_runs: list[dict]) -> None:
    (record,) = block_runs[2]["metrics"]
    assert record["step"] == 3
    assert record["tokens_per_s"] * record["step_time_s"] == pytest.approx(GBS * SEQ_LEN)  # step 3 alone is timed
    assert record["tokens_seen"] == block_runs[2]["summary"]["tokens_seen"] == 3 * GBS * SEQ_LEN


def _prompt_completion(base: Path) -> dict[str, Any]:
    # 34 generated records: 32 train (one epoch = two global batches of 16, every record once) and 2 validation
    return {
        "model": {"pretrained": str(base)},
        "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(base), "num_samples": 34,
                 "seq_len": 40, "global_batch_size": 16, "micro_batch_size": 4, "packing": True,
                 "val_fraction": 0.05},
        "train": {"steps": 4, "log_every": 1, "eval_every": 0},
        "checkpoint": {"every_n_steps": 3},
    }


@pytest.fixture(scope="module")
def prompt_completion_runs(pretrained_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 ranks, shuffled packed rows: 4 steps straight (a checkpoint at step 3, halfway through the second epoch);
    step 4 resumed from that checkpoint, and from a copy of it without the recorded count (an earlier version's)."""
    tmp = tmp_path_factory.mktemp("prompt_completion")
    base = _prompt_completion(pretrained_base)
    (straight,) = run_distributed(train_each, 2, str(tmp / "straight"), base, [{}])[0]
    checkpoint = Path(straight["dir"]) / "checkpoints" / "step_000003"
    earlier = tmp / "earlier" / checkpoint.name
    recorded = without_token_count(checkpoint, earlier)
    resumed = run_distributed(train_each, 2, str(tmp / "resumed"), base,
                              [{"train": {"resume": str(checkpoint)}}, {"train": {"resume": str(earlier)}}])[0]
    lengths = [len(ids) for ids in build_token_data(make_config(str(tmp), base).data).train["input_ids"]]
    return {"straight": straight, "resumed": resumed[0], "earlier": resumed[1], "recorded": recorded,
            "lengths": lengths}


def test_a_resumed_prompt_completion_run_continues_the_token_count(prompt_completion_runs: dict[str, Any]) -> None:
    straight, resumed = prompt_completion_runs["straight"], prompt_completion_runs["resumed"]
    lengths = prompt_completion_runs["lengths"]
    assert len(lengths) == 32  # an epoch visits every example once, whatever the shuffled order
    seen = _seen(straight)
    assert seen[1] == sum(lengths) and seen[3] == 2 * sum(lengths)
    assert sum(lengths) < seen[2] < 2 * sum(lengths)
    assert prompt_completion_runs["recorded"] == seen[2]  # the checkpoint of step 3 records the count
    assert _seen(resumed) == seen[3:]
    assert resumed["summary"]["tokens_seen"] == straight["summary"]["tokens_seen"] == seen[3]


def test_a_checkpoint_without_a_token_count_resumes_with_the_count_its_data_position_implies(
    prompt_completion_runs: dict[str, Any],
) -> None:
    assert _seen(prompt_completion_runs["earlier"]) == _seen(prompt_completion_runs["straight"])[3:]
