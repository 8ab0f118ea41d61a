"""The fault matrix: one non-finite step injected into every pair of features (an all-pairs design over ZeRO stage,
compression, engine, precision, packing, LoRA, activation checkpointing, the chunked loss, the replica drift check's
policy and compile), on 2 forked gloo ranks.

Each row trains a tiny model (1 layer, width 32) for 4 steps with rank 1's loss poisoned at step 3, three times:
``skip`` goes on with finite steps and exactly one skipped update; ``abort`` stops at step 3 with one line on every
rank and no checkpoint after step 2; resuming that checkpoint with ``skip`` ends bitwise equal to the ``skip`` run
(model and optimizer state). fp16 rows also overflow rank 1's gradients from a finite loss under ``abort``: a
back-off of the loss scale, not a policy event. Pairs the product refuses are checked to be refused with one line.
The test ids list each row's levels; every pair those rows cover is every pair the product accepts (checked).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.app.preflight import validate_config
from ddptrain.checkpoint.offline import read_tensors, tensor_entries
from ddptrain.data.instruct import generated_instructions
from ddptrain.data.tokenizer import train_bpe
from ddptrain.errors import ConfigError
from tests.helpers.dist import run_distributed
from tests.helpers.drift_checks import outcomes_counting_checks
from tests.helpers.pairwise import Row, all_pairs, pairs_of, refused_pairs, row_pairs
from tests.helpers.runs import Overrides, make_config

FACTORS: dict[str, list[Any]] = {  # the first level of each factor is the plain one, chosen when a row is free
    "zero": [0, 1, 2, 3],
    "compression": ["none", "fp16", "bf16", "powersgd", "topk"],
    "engine": ["torch", "bucketed"],
    "precision": ["fp32", "bf16", "fp16"],
    "packing": [False, True],
    "lora": [False, True],
    "checkpointing": [False, True],
    "chunked": [True, False],  # train.chunked_loss (on by default), in chunks of CHUNK tokens: several per batch
    "drift": ["abort", "rebroadcast", "off"],  # train.drift_policy: the replicas compared at every check, or not
}
# Compile is not paired with every feature: a compiled run costs half a minute of compilation on a loaded 2-core
# CPU (each run compiles afresh, as a process of its own would), so one compiled row stands for it (below).
COMPILED_ROW: Row = {"zero": 0, "compression": "none", "engine": "torch", "precision": "fp32", "packing": False,
                     "lora": False, "checkpointing": False, "chunked": True, "drift": "abort", "compile": True}
# The product's refusals, one pair each (tests/test_fault_matrix.py checks that the product refuses exactly these)
REFUSED_WHEN = [
    ("zero", lambda v: v >= 2, "compression", lambda v: v != "none", "cannot be combined with parallel.zero_stage"),
    ("zero", lambda v: v != 0, "engine", lambda v: v != "torch", "cannot be combined with parallel.zero_stage"),
    ("compression", lambda v: v != "none", "engine", lambda v: v != "torch",
     "cannot be combined with parallel.compression"),
    ("engine", lambda v: v != "torch", "compile", bool, "train.compile=true cannot be combined with parallel.engine"),
    ("zero", lambda v: v >= 2, "lora", bool, "model.lora.enabled=true cannot be combined with parallel.zero_stage"),
]
BAD_STEP, STEPS, CHUNK = 3, 4, 8
NAN, OVERFLOW = f"nan@step:{BAD_STEP}:1", f"overflow@step:{BAD_STEP}:1"


def allowed(row: Row) -> bool:
    return not any(a in row and b in row and fa(row[a]) and fb(row[b]) for a, fa, b, fb, _ in REFUSED_WHEN)


ROWS = [{**row, "compile": False} for row in all_pairs(FACTORS, allowed)]
# + the one refusal that concerns compile
REFUSED = [*refused_pairs(FACTORS, allowed), (("engine", "bucketed"), ("compile", True))]


def row_id(row: Row) -> str:
    """The row's levels, plain ones included: e.g. zero1-topk-torch-fp16-packed-lora-ckpt-chunked-eager."""
    return "-".join([
        f"zero{row['zero']}", row["compression"] if row["compression"] != "none" else "uncompressed", row["engine"],
        row["precision"], "packed" if row["packing"] else "blocks", "lora" if row["lora"] else "full",
        "ckpt" if row["checkpointing"] else "nockpt", "chunked" if row["chunked"] else "logits",
        f"drift{row['drift']}", "compiled" if row["compile"] else "eager",
    ])


def pair_id(pair: tuple) -> str:
    (a, va), (b, vb) = pair
    return f"{a}={va}+{b}={vb}"


BASE: Overrides = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 64},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 128, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": STEPS, "log_every": 1, "eval_every": 0, "nan_policy": "skip"},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 2},
}


def overrides(row: Row, tokenizer: Path | None) -> Overrides:
    """The config of ``row``, layered over BASE."""
    parallel: dict[str, Any] = {"zero_stage": row["zero"], "compression": row["compression"], "engine": row["engine"]}
    if row["compression"] == "powersgd":
        parallel["powersgd_start_iter"] = 2  # compresses from step 3 on: the bad step is its first compressed one
    model: dict[str, Any] = {"activation_checkpointing": "full" if row["checkpointing"] else "none"}
    if row["lora"]:
        model["lora"] = {"enabled": True, "r": 4, "alpha": 8.0}
    out: Overrides = {"parallel": parallel, "model": model,
                      "train": {"precision": row["precision"], "compile": row["compile"],
                                "chunked_loss": row["chunked"], "loss_chunk_tokens": CHUNK,
                                "drift_policy": row["drift"]}}
    if row["packing"]:
        out["data"] = {"source": "instructions", "format": "prompt_completion", "packing": True,
                       "tokenizer": str(tokenizer), "num_samples": 64, "seq_len": 40}
    return out


def merged(*layers: Overrides) -> Overrides:
    out: Overrides = {}
    for layer in layers:
        for section, keys in layer.items():
            out[section] = {**out.get(section, {}), **keys}
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE for the packed rows' prompt/completion examples."""
    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe([f"{p} {c}" for p, c in generated_instructions(200)], 320).save_pretrained(out)
    return out


def test_the_rows_cover_every_pair_the_product_accepts_in_few_rows() -> None:
    covered = set().union(*(row_pairs({f: row[f] for f in FACTORS}) for row in ROWS))
    accepted = [p for p in pairs_of(FACTORS) if allowed(dict(p))]
    assert set(accepted) <= covered and all(allowed(row) for row in ROWS)
    assert len(ROWS) <= 24, len(ROWS)  # the full product has 4*5*2*3*2*2*2*2 = 1920 combinations


@pytest.mark.parametrize("pair", REFUSED, ids=[pair_id(p) for p in REFUSED])
def test_a_refused_pair_is_refused_with_one_line_naming_the_keys(pair: tuple, tmp_path: Path) -> None:
    row = {f: levels[0] for f, levels in FACTORS.items()} | {"compile": False} | dict(pair)
    (reason,) = [r for a, fa, b, fb, r in REFUSED_WHEN if fa(row[a]) and fb(row[b])]
    with pytest.raises(ConfigError) as refused:
        validate_config(make_config(str(tmp_path), BASE, overrides(row, tmp_path)), 2)
    assert reason in str(refused.value) and "\n" not in str(refused.value)


def _final_state(run_dir: str) -> dict[str, torch.Tensor]:
    checkpoint = Path(run_dir) / "checkpoints" / f"step_{STEPS:06d}"
    return read_tensors(checkpoint, sorted(tensor_entries(checkpoint)))


@pytest.mark.slow  # about 3 s a row on an idle 2-core machine: a minute for the matrix
@pytest.mark.parametrize("row", ROWS, ids=[row_id(r) for r in ROWS])
def test_one_non_finite_step_is_skipped_or_aborted_alike_and_resumes_bitwise(
    row: Row, tmp_path: Path, tokenizer: Path
) -> None:
    check_row(row, tmp_path, tokenizer)


@pytest.mark.slow
def test_a_compiled_run_skips_or_aborts_one_non_finite_step_alike_and_resumes_bitwise(tmp_path: Path) -> None:
    check_row(COMPILED_ROW, tmp_path, None)


def check_row(row: Row, tmp_path: Path, tokenizer: Path | None) -> None:
    """Train ``row`` skip, abort, resume (and fp16's overflow) on 2 ranks and check each outcome."""
    base = merged(BASE, overrides(row, tokenizer))
    validate_config(make_config(str(tmp_path), base), 2)  # the product accepts this row
    checkpoint = tmp_path / "abort" / "checkpoints" / "step_000002"
    last_only = {"checkpoint": {"every_n_steps": 0}}  # a save costs ~0.5 s here: only the abort run needs step 2's
    variants = [("skip", last_only, NAN), ("abort", {"train": {"nan_policy": "abort"}}, NAN),
                ("resume", {"train": {"resume": str(checkpoint)}, **last_only}, NAN)]
    if row["precision"] == "fp16":
        variants.append(("overflow", {"train": {"nan_policy": "abort"}, **last_only}, OVERFLOW))
    ranks = run_distributed(outcomes_counting_checks, 2, str(tmp_path), base, variants, timeout=300)
    runs = {name: [ranks[r][i] for r in (0, 1)] for i, (name, _, _) in enumerate(variants)}
    # the chunked loss ran in every run of a chunked row, in several chunks a micro batch, and in none of the others
    for outcome in (o for rank_runs in runs.values() for o in rank_runs):
        assert (outcome["calls"] > 0 and outcome["chunks"] > outcome["calls"]) if row["chunked"] else (
            outcome["calls"] == 0), (outcome["dir"], outcome["calls"], outcome["chunks"])

    # the replicas were compared at the checks (every step logs: a check each) unless the policy is off or ZeRO-2/3
    # shards them (nothing to compare), and never differed: a skipped step is skipped alike on every rank
    compares = row["drift"] != "off" and row["zero"] < 2
    for outcome in (o for rank_runs in runs.values() for o in rank_runs):
        assert (outcome["compared"] > 0) == compares and outcome["differed"] == 0, (
            outcome["dir"], outcome["compared"], outcome["differed"])

    skip = runs["skip"][0]["metrics"]
    norms = {m["step"]: m["grad_norm"] for m in skip}
    assert not math.isfinite(norms.pop(BAD_STEP)) and all(math.isfinite(n) for n in norms.values()), norms
    assert all(math.isfinite(m["loss"]) for m in skip if m["step"] != BAD_STEP)
    assert [m["skipped_steps"] for m in skip] == [0] * (BAD_STEP - 1) + [1] * (STEPS - BAD_STEP + 1)
    if row["precision"] == "fp16":
        assert skip[-1]["scaler_backoffs"] == 0  # a non-finite loss is a policy event, not a back-off

    aborted = runs["abort"]
    assert [o["exit_code"] for o in aborted] == [3, 3]
    assert all(o["error"].startswith(f"non-finite loss or gradients at step {BAD_STEP}") and "\n" not in o["error"]
               for o in aborted)
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_000002"]

    resumed = runs["resume"][0]["metrics"]
    assert [m["step"] for m in resumed] == list(range(BAD_STEP, STEPS + 1))
    assert resumed[-1]["skipped_steps"] == 1
    if row["compression"] == "powersgd":
        # PowerSGD's state (its step count, warm-start matrices, generator) is not in the checkpoint: a resumed
        # run restarts it uncompressed, so only the losses after the skip are finite, not bitwise equal
        assert all(math.isfinite(m["loss"]) for m in resumed[1:])
    else:
        straight, again = _final_state(runs["skip"][0]["dir"]), _final_state(runs["resume"][0]["dir"])
        assert straight.keys() == again.keys()
        assert [k for k in straight if not torch.equal(straight[k], again[k])] == []

    if row["precision"] == "fp16":
        overflow = runs["overflow"]
        assert [o["error"] for o in overflow] == [None, None]
        metrics = overflow[0]["metrics"]
        assert (metrics[-1]["skipped_steps"], metrics[-1]["scaler_backoffs"]) == (0, 1)
        assert not math.isfinite(metrics[BAD_STEP - 1]["grad_norm"]) and math.isfinite(metrics[-1]["grad_norm"])
