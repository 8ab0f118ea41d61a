"""One checkpoint format for every strategy: resume across strategies and world sizes, exact data position,
offline info/export/verify, asynchronous saves."""

from __future__ import annotations

import json
import logging
import runpy
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from ddptrain.checkpoint import offline
from ddptrain.checkpoint.cli import run as ckpt_tool
from ddptrain.checkpoint.format import manifest
from ddptrain.data import BatchShape, MicroBatches, SampleOrder
from tests.helpers.cli import DDPTRAIN_CKPT, test_env
from tests.helpers.dist import run_distributed
from tests.helpers.runs import Overrides, make_config, train_each
from tests.helpers.tiny import TINY_MODEL

log = logging.getLogger(__name__)

# Global batch 12: 2 micro batches of 2 per rank on 3 ranks, 3 on 2 ranks, 6 on 1 rank.
BASE: Overrides = {
    "model": {**TINY_MODEL, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 96, "seq_len": 16, "global_batch_size": 12,
             "micro_batch_size": 2},
    "train": {"steps": 3, "log_every": 1, "eval_every": 0},
    "optim": {"warmup_steps": 1},
    "checkpoint": {"every_n_steps": 2},
    "parallel": {"wrap_single": True},  # on 1 rank too, each strategy wraps the model (not the bare model)
}
STRATEGIES: dict[str, Overrides] = {
    "ddp": {}, "bucketed": {"parallel": {"engine": "bucketed"}}, "zero1": {"parallel": {"zero_stage": 1}},
    "zero3": {"parallel": {"zero_stage": 3}},
}
SAVED_AT = 2  # every source run saves at step 2 (and 3, its last); resumed runs train step 3 from step 2's


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One uninterrupted 2-rank run per strategy (ZeRO-3 also exports its final model), and DDP once more with
    asynchronous saves: metrics and checkpoints."""
    tmp = tmp_path_factory.mktemp("sources")
    variants = {**STRATEGIES, "zero3": {**STRATEGIES["zero3"], "checkpoint": {"every_n_steps": 2, "export": True}},
                "ddp_async": {"checkpoint": {"every_n_steps": 2, "async_save": True}}}
    results = run_distributed(train_each, 2, str(tmp), BASE, list(variants.values()))[0]
    out = {}
    for name, result in zip(variants, results, strict=True):
        run_dir = Path(result["dir"])
        out[name] = {"metrics": result["metrics"], "dir": run_dir,
                     "checkpoint": run_dir / "checkpoints" / f"step_{SAVED_AT:06d}"}
    return out


def _load_and_resume(rank: int, world_size: int, tmp: str, jobs: list[tuple[str, str, str]]) -> list[dict]:
    """For each (source, target, checkpoint): the full state and learning rate right after ``Checkpointer.load``
    under the target, then the loss of training on from the checkpoint through the real loop."""
    from ddptrain.checkpoint import Checkpointer
    from ddptrain.checkpoint.state import named_state
    from ddptrain.models import build_model, model_vocab_size
    from ddptrain.optim import build_optimizer, build_scheduler
    from ddptrain.parallel import wrap_model

    loaded = []
    for source, target, checkpoint in jobs:
        cfg = make_config(tmp, BASE, STRATEGIES[target])
        model = build_model(cfg.model, model_vocab_size(cfg.model, cfg.data.vocab_size), eos_id=0)
        wrapped = wrap_model(model, cfg.parallel, torch.device("cpu"))
        optimizer = build_optimizer(model, cfg.optim, cfg.parallel.zero_stage)
        build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        checkpointer = Checkpointer(cfg, Path(tmp) / f"load-{source}-{target}", wrapped.strategy)
        checkpointer.load(Path(checkpoint), model, optimizer)
        state = named_state(model, optimizer)
        tensors = {f"{section}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
                   for section in ("model", "optim") for key, value in state[section].items()
                   if isinstance(value, torch.Tensor)}
        loaded.append({"tensors": tensors, "lr": [group["lr"] for group in optimizer.param_groups]})
    variants = [{**STRATEGIES[target], "train": {"resume": checkpoint}} for _, target, checkpoint in jobs]
    resumed = train_each(rank, world_size, tmp, BASE, variants)
    return [{**state, "losses": [m["loss"] for m in run["metrics"]]}
            for state, run in zip(loaded, resumed, strict=True)]


# every pair on 1 and on 2 ranks: a dozen resumed runs each, about 12 CPU seconds: the slow tier; the 3-rank case
# (one pair) stays in the fast one
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow),
                                        pytest.param(2, marks=pytest.mark.slow), 3])
def test_every_strategy_resumes_every_other_on_any_world_size(
    tmp_path: Path, sources: dict[str, dict[str, Any]], world_size: int
) -> None:
    pairs = [(s, t) for s in STRATEGIES for t in STRATEGIES if s != t]
    if world_size == 3:  # 3 ranks on a 2-core machine are slow: one case, an engine's state resharded 2 -> 3 by FSDP2
        pairs = [("bucketed", "zero3")]
    jobs = [(s, t, str(sources[s]["checkpoint"])) for s, t in pairs]
    per_rank = run_distributed(_load_and_resume, world_size, str(tmp_path), jobs, timeout=600)
    for i, (source, target, checkpoint) in enumerate(jobs):
        case = f"{source} (2 ranks) -> {target} ({world_size} ranks)"
        saved = offline.read_tensors(Path(checkpoint), list(offline.tensor_entries(Path(checkpoint))))
        union: dict[str, torch.Tensor] = {}
        for rank_results in per_rank:
            union.update(rank_results[i]["tensors"])  # ZeRO-1 ranks hold disjoint optimizer entries
        assert union.keys() == saved.keys(), case
        different = [k for k in saved if not torch.equal(union[k], saved[k])]
        assert not different, f"{case}: weights or optimizer state not bitwise equal after loading: {different[:4]}"
        uninterrupted = sources[source]["metrics"][SAVED_AT]  # step 3: its lr, and its loss (before its update)
        assert per_rank[0][i]["lr"] == [uninterrupted["lr"]] * 2, case
        (loss,) = per_rank[0][i]["losses"]
        assert loss == pytest.approx(uninterrupted["loss"], rel=1e-5), case  # same weights, same global batch


def test_an_asynchronous_save_writes_what_a_synchronous_one_does(sources: dict[str, dict[str, Any]]) -> None:
    # Step 3 trained while step 2's save was written from its host copy: the copy, not the live tensors, is saved.
    assert [m["loss"] for m in sources["ddp_async"]["metrics"]] == [m["loss"] for m in sources["ddp"]["metrics"]]
    for step in (2, 3):
        checkpoints = [sources[name]["dir"] / "checkpoints" / f"step_{step:06d}" for name in ("ddp", "ddp_async")]
        keys = list(offline.tensor_entries(checkpoints[0]))
        sync, async_ = (offline.read_tensors(c, keys) for c in checkpoints)
        assert all(torch.equal(sync[k], async_[k]) for k in keys), f"step {step}"


def _train_recording_the_writer(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Train with asynchronous saves, recording which thread commits each checkpoint and when, and when each step
    begins; a commit before the last step is held back until the next step has begun (5 s at most), so that a
    commit on the training thread, which holds that step back, could not pass unnoticed."""
    import threading
    import time

    from ddptrain.checkpoint import Checkpointer
    from ddptrain.telemetry.metrics import StepMetrics

    events: dict[str, Any] = {"commits": [], "starts": {}}
    commit, start_step = Checkpointer._commit, StepMetrics.start_step
    begun: defaultdict[int, threading.Event] = defaultdict(threading.Event)

    def slow_commit(self: Checkpointer, tmp_dir: Path, final: Path, meta: dict[str, Any]) -> None:
        if meta["step"] < BASE["train"]["steps"]:
            begun[meta["step"] + 1].wait(timeout=5)
        events["commits"].append((meta["step"], threading.current_thread().name, time.perf_counter()))
        commit(self, tmp_dir, final, meta)

    def recorded_start(self: StepMetrics, step: int) -> None:
        events["starts"][step] = time.perf_counter()
        begun[step].set()
        start_step(self, step)

    Checkpointer._commit = slow_commit  # type: ignore[method-assign]
    StepMetrics.start_step = recorded_start  # type: ignore[method-assign]
    train_each(rank, world_size, tmp, BASE, [{"checkpoint": {"every_n_steps": 2, "async_save": True}}])
    return events


def test_an_asynchronous_save_is_committed_by_the_background_writer_while_the_next_step_runs(tmp_path: Path) -> None:
    events = run_distributed(_train_recording_the_writer, 2, str(tmp_path))[0]  # rank 0 commits
    commits = {step: (thread, at) for step, thread, at in events["commits"]}
    assert sorted(commits) == [2, 3]
    assert all(thread.startswith("checkpoint") for thread, _ in commits.values()), commits  # the background writer
    assert events["starts"][3] < commits[2][1], "step 3 must begin before step 2's checkpoint is committed"


def _stream(dataset: Dataset, dp: int, rank: int) -> MicroBatches:
    plan = BatchShape.derive(8, 2, None, dp, 4)
    return MicroBatches(dataset, plan, rank, SampleOrder(seed=5, shuffle=True), num_workers=0,
                        device=torch.device("cpu"))


def _consume(dataset: Dataset, dp: int, steps: int, state: dict[str, int] | None) -> tuple[list[int], dict]:
    """Sample indices that ``steps`` optimizer steps on ``dp`` ranks consume, and the data position after them."""
    streams = [_stream(dataset, dp, rank) for rank in range(dp)]
    for stream in streams:
        if state is not None:
            stream.load_state_dict(state)
    seen = [i for _ in range(steps * 8 // (2 * dp)) for s in streams for i in next(s)[:, 0].tolist()]
    positions = {str(s.state_dict()) for s in streams}
    assert len(positions) == 1, "every rank must hold the same global position"
    return seen, streams[0].state_dict()


def test_data_position_is_exact_across_two_one_two_ranks() -> None:
    # 44 samples: epochs of 40 (5 global batches of 8); 12 steps cross two epoch boundaries.
    ds = Dataset.from_dict({"input_ids": [[i] * 4 for i in range(44)]}).with_format("torch")
    straight, _ = _consume(ds, 2, 12, None)
    first, state = _consume(ds, 2, 3, None)
    second, state = _consume(ds, 1, 4, state)
    third, _ = _consume(ds, 2, 5, state)
    log.info("uninterrupted: %s", straight)
    log.info("2 -> 1 -> 2 ranks: %s | %s | %s", first, second, third)
    assert Counter(first + second + third) == Counter(straight)
    resumed = first + second + third
    for step in range(12):  # each optimizer step sees the same global batch, whatever the world size
        assert sorted(resumed[8 * step : 8 * step + 8]) == sorted(straight[8 * step : 8 * step + 8]), step


@pytest.mark.slow  # one process of the installed command: what the in-process export below does not show
def test_the_installed_ddptrain_ckpt_verifies_a_run_from_a_directory_outside_the_checkout(
    tmp_path: Path, sources: dict[str, dict[str, Any]]
) -> None:
    """``ddptrain-ckpt`` as a user runs it: the environment's console script, from a temporary directory, with no
    ``PYTHONPATH`` (tests/helpers/cli.py)."""
    run_dir = sources["zero3"]["dir"]
    out = subprocess.run([*DDPTRAIN_CKPT, "verify", str(run_dir)], cwd=tmp_path, capture_output=True, text=True,
                         env=test_env(tmp_path / "cache"), timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step_000003" in out.stdout and "tensors read; shapes match the model, all values finite" in out.stdout


def test_export_of_a_zero3_checkpoint_on_one_process_matches_the_run_export(
    tmp_path: Path, sources: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m ddptrain.checkpoint export``, run as that module's ``__main__`` in this one process (no process
    group: the sharded checkpoint is merged offline)."""
    run_dir = sources["zero3"]["dir"]
    monkeypatch.setattr(sys, "argv", ["ddptrain-ckpt", "export", str(run_dir), str(tmp_path / "x")])
    with pytest.raises(SystemExit) as ended:
        runpy.run_module("ddptrain.checkpoint", run_name="__main__")
    out, err = capsys.readouterr()
    assert ended.value.code in (0, None), err[-3000:]
    assert "step_000003" in out  # a run directory means its latest checkpoint: the final step
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [AutoModelForCausalLM.from_pretrained(str(p))(input_ids=ids).logits for p in (tmp_path / "x",
                                                                                         run_dir / "model")]
    assert torch.equal(logits[0], logits[1])


def test_info_and_verify_read_a_sharded_checkpoint(
    sources: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = sources["zero3"]["checkpoint"]
    assert ckpt_tool(["info", str(checkpoint), "parallel.zero_stage=1", "data.global_batch_size=16"]) == 0
    shown = capsys.readouterr().out
    for expected in ("step         2", "FSDP2 (ZeRO-3) on 2 ranks (global batch 12)", "24 samples of the epoch",
                     "parallel.zero_stage: 3 -> 1", "data.global_batch_size: 12 -> 16"):
        assert expected in shown, shown
    assert ckpt_tool(["verify", str(checkpoint)]) == 0
    assert "shapes match the model, all values finite" in capsys.readouterr().out


def test_info_diffs_the_checkpoint_against_its_runs_own_config_not_the_defaults(
    tmp_path: Path, sources: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """``info PATH`` compared the checkpoint with the defaults, so it listed every choice the run made (its tiny
    model, synthetic data). It compares with the run's own config.yaml (here, a later launch's larger batch), and
    with ``key=value`` overrides on top of it."""
    import shutil

    import yaml

    checkpoint = sources["ddp"]["checkpoint"]
    assert ckpt_tool(["info", str(checkpoint)]) == 0  # no run config.yaml beside it: the checkpoint's own
    assert capsys.readouterr().out.splitlines()[-1] == "config diff  none"
    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent, run / "checkpoints")
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    batch, lr = saved["data"]["global_batch_size"], saved["optim"]["lr"]
    saved["data"]["global_batch_size"] = 2 * batch  # what a later launch of the run composed
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert ckpt_tool(["info", str(run), "optim.lr=0.5"]) == 0
    shown = capsys.readouterr().out.splitlines()
    at = shown.index("config diff  (checkpoint -> run config + overrides)")
    assert shown[at + 1:] == [f"  data.global_batch_size: {batch} -> {2 * batch}", f"  optim.lr: {lr} -> 0.5"]
    assert ckpt_tool(["info", str(run), "model=gpt2_small"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ddptrain-ckpt: error: model=gpt2_small: expected key=value for a key of the run's config (info diffs "
        "against the run's own config.yaml: config groups cannot be chosen here)")


def test_verify_finds_a_non_finite_tensor_and_a_missing_checkpoint_is_one_line(
    tmp_path: Path, sources: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "step_000002"
    shutil.copytree(sources["ddp"]["checkpoint"], checkpoint)
    keys = list(offline.tensor_entries(checkpoint))
    tensors = offline.read_tensors(checkpoint, keys)
    tensors["model.lm_head.weight"][0, 0] = float("nan")
    shutil.rmtree(checkpoint / "state")
    dcp.save(tensors, checkpoint_id=str(checkpoint / "state"), no_dist=True)
    assert ckpt_tool(["verify", str(checkpoint)]) == 1  # the rewritten state/ no longer matches the commit's record
    assert "state/__1_0.distcp: missing" in capsys.readouterr().out
    meta = json.loads((checkpoint / "COMMITTED").read_text())
    meta["files"] = manifest(checkpoint, skip=frozenset({"COMMITTED"}))  # as if the NaN had been saved
    (checkpoint / "COMMITTED").write_text(json.dumps(meta))
    assert ckpt_tool(["verify", str(checkpoint)]) == 1
    assert "model.lm_head.weight: 1 non-finite values" in capsys.readouterr().out
    assert ckpt_tool(["info", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"ddptrain-ckpt: error: PATH={tmp_path / 'nope'}: no such checkpoint " \
                                              "or run directory"
    (checkpoint / "COMMITTED").write_text('{"step": 2, "zero_stage": 0}\n')  # what the per-strategy layout wrote
    assert ckpt_tool(["verify", str(checkpoint)]) == 2
    assert "has checkpoint format 1; this ddptrain reads format 2" in capsys.readouterr().err
