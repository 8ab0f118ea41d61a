"""The run summary is a typed value (``telemetry/summary.py``); ``summary.json`` is its record, key for key and in
order, as it was when the summary was a dict."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ddptrain.telemetry.summary import RunSummary
from tests.helpers.dist import run_distributed
from tests.helpers.trainers import train_each_with

BASE = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 2, "eval_every": 2},  # two windows, each with an evaluation
}

# summary.json's keys before the medians, in order (the dict the typed summary replaced built them so)
LEADING = ["world_size", "model", "parameters", "trainable_parameters", "engine", "zero_stage", "compression",
           "wrapper", "global_batch_size", "micro_batch_size", "grad_accum", "seq_len", "steps", "first_step_loss",
           "first_logged_step", "first_logged_loss", "final_loss", "final_val_loss", "tokens_seen"]
TRAILING = ["flops_per_token", "peak_tflops", "predicted", "model_state", "buckets", "memory_peak", "goodput_pct",
            "goodput"]


def _train_keeping_step_ones_loss(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """``train_each`` of BASE through a trainer that also returns step 1's loss as the step computed it."""
    from ddptrain.step.compute import Stepped
    from ddptrain.train.trainer import Trainer

    seen: list[float] = []
    in_progress: list[tuple[int, int]] = []  # (step, the step a stop request's notice would count from)

    class KeepsStepOne(Trainer):
        def train_step(self, step: int, check: bool) -> Stepped:
            in_progress.append((step, self.stop.step))
            done = super().train_step(step, check)
            if step == 1:
                seen.append(float(done.loss))
            return done

    (run,) = train_each_with(KeepsStepOne, rank, world_size, tmp, BASE, [{}])
    return {**run, "first_step_loss": seen[0], "stop_steps": in_progress}


def test_summary_json_is_the_typed_summarys_record_in_the_same_order(tmp_path: Path) -> None:
    run = run_distributed(_train_keeping_step_ones_loss, 1, str(tmp_path))[0]
    text = (Path(run["dir"]) / "summary.json").read_text()
    record = json.loads(text)
    keys = list(record)
    assert keys[:len(LEADING)] == LEADING and keys[-len(TRAILING):] == TRAILING
    assert "time_step_s" in keys[len(LEADING):-len(TRAILING)]  # the steady-state medians between them
    assert run["summary"] == record  # what train() returns is the same record
    again = RunSummary.from_json(record)
    assert json.dumps(again.to_json(), indent=2) + "\n" == text
    assert again.steady.time_step_s == record["time_step_s"] and again.world_size == 1
    # the losses say which step's they are: the last evaluation's, the first and last windows', step 1's
    windows = run["metrics"]
    assert [m["step"] for m in windows] == [2, 4] and windows[0]["val_loss"] != windows[-1]["val_loss"]
    assert record["final_val_loss"] == windows[-1]["val_loss"]
    assert (record["first_logged_step"], record["first_logged_loss"]) == (2, windows[0]["loss"])
    assert record["final_loss"] == windows[-1]["loss"]
    assert record["first_step_loss"] == run["first_step_loss"] != record["first_logged_loss"]
    # a stop request's notice counts from the step in progress (a signal within step 2 may come after its check)
    assert run["stop_steps"] == [(1, 1), (2, 2), (3, 3), (4, 4)], run["stop_steps"]


def test_an_earlier_summarys_first_loss_reads_back_as_the_first_logged_loss_and_no_median() -> None:
    """Before the losses were named for their steps, ``first_loss`` held the first logged window's loss."""
    record = {**dict.fromkeys(LEADING, 1), "time_step_s": 0.5}
    for name in ("first_step_loss", "first_logged_step", "first_logged_loss"):
        del record[name]
    summary = RunSummary.from_json({**record, "first_loss": 8.35})
    assert summary.first_logged_loss == 8.35 and summary.first_step_loss is None
    assert summary.steady.medians == {"time_step_s": 0.5}


def test_fp16s_final_scale_replaces_its_median_in_place_and_the_compile_time_follows_the_fixed_figures() -> None:
    record = {**dict.fromkeys(LEADING, 1), "time_step_s": 0.5, "loss_scale": 1024.0, "scaler_backoffs": 0,
              **dict.fromkeys(TRAILING[:5], 2), "compile_s": 3.0, "memory_peak": {"planned_bytes": 1},
              "goodput_pct": 90.0, "goodput": {}}
    summary = RunSummary.from_json(record)
    assert summary.loss_scale == {"loss_scale": 1024.0, "scaler_backoffs": 0} and summary.compile_s == 3.0
    summary.loss_scale = {"loss_scale": 512.0, "scaler_backoffs": 1}
    out = summary.to_json()
    assert list(out) == list(record)
    assert out["loss_scale"] == 512.0 and out["scaler_backoffs"] == 1


ONE_RANK: dict[str, dict[str, Any]] = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 64, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 2, "check_every": 2, "eval_every": 2},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 0},
}


def test_a_one_rank_run_in_this_process_writes_the_summary_its_windows_give(
        tmp_path: Path, caplog: Any) -> None:
    """The loop, the step, the logging windows and the summary, in the test process (a 1-rank gloo group): mutation
    testing sees them here, where the multi-rank runs reach them only in forked ranks. 4 steps, a window of 2."""
    import logging

    import torch
    import torch.distributed as dist

    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import Trainer
    from tests.helpers.runs import make_config

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
        trainer = Trainer(make_config(str(tmp_path), ONE_RANK), env, torch.device("cpu"), tmp_path, {})
        before = [p.detach().clone() for p in trainer.model.parameters()]
        with caplog.at_level(logging.INFO, logger="ddptrain"):
            summary = trainer.train()
    finally:
        dist.destroy_process_group()
    windows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [2, 4]
    assert all(w["skipped_steps"] == 0 and isinstance(w["lr"], float) and "val_loss" in w for w in windows)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert (summary["first_logged_step"], summary["first_logged_loss"]) == (2, windows[0]["loss"])
    assert (summary["final_loss"], summary["final_val_loss"]) == (windows[-1]["loss"], windows[-1]["val_loss"])
    assert summary["tokens_seen"] == windows[-1]["tokens_seen"] == 4 * 4 * 16
    assert isinstance(summary["first_step_loss"], float) and summary["flops_per_token"] > 0
    assert (summary["compression"], summary["wrapper"], summary["world_size"]) == ("none", "none", 1)
    assert summary["predicted"]["comm_link_bytes_per_rank"] == 0.0 and summary["predicted"]["step_note"]
    assert summary["time_optimizer_s"] > 0 and summary["step_time_s"] > 0
    assert summary["memory_peak"] and summary["model_state"]["shard_group_size"] == 1
    # goodput's last line, with the final save and the evaluations booked apart from training
    assert re.fullmatch(r"goodput [\d.]+% of [\d.]+ s wall-clock: start-up [\d.]+%, .*", caplog.messages[-1])
    assert summary["goodput"]["checkpoint_s"] > 0 and summary["goodput"]["eval_s"] > 0
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_the_first_steps_line_in_this_process_gives_the_bytes_its_gradient_sync_sent(
        tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    """One rank wrapped in torch DDP anyway (parallel.wrap_single=true), in the test process: the first step's line
    gives the bytes that step's all-reduce sent (its sync sample's), as the logged comm_bytes does; the bare model
    syncs nothing and its line gives none."""
    import logging

    from tests.helpers.in_process import train_here

    lines = {}
    for name, wrap in (("ddp", True), ("bare", False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ddptrain"):
            ran = train_here(tmp_path / name, monkeypatch, {"parallel": {"wrap_single": wrap}})
        (lines[name],) = [m for m in caplog.messages if re.match(r"[\d.]+K of [\d.]+K trainable", m)]
        if wrap:
            assert ran.windows[0]["comm_bytes"] > 0
            sent = ran.windows[0]["comm_bytes"]
    assert re.fullmatch(rf"[\d.]+K of [\d.]+K trainable; {sent / 1e6:.3g} MB all-reduced per step", lines["ddp"])
    assert re.fullmatch(r"[\d.]+K of [\d.]+K trainable", lines["bare"])


def test_a_compiled_run_whose_first_step_logs_keeps_that_step_in_its_window(tmp_path: Path, monkeypatch: Any) -> None:
    """train.compile=true with a window every step: the first step's window would be left empty if compilation were
    taken out of it (that is done only when the first step does not log). Compilation itself is patched out here
    (the blocks stay eager: the loop's bookkeeping is what is tested, in the test process)."""
    from ddptrain.parallel.zero import transformer_blocks
    from ddptrain.train import trainer
    from tests.helpers.in_process import train_here

    monkeypatch.setattr(trainer, "compile_blocks", lambda model, varying_shapes: len(transformer_blocks(model)))
    ran = train_here(tmp_path, monkeypatch, {"train": {"compile": True, "log_every": 1}})
    assert ran.error is None and [w["step"] for w in ran.windows] == [1, 2]
    assert all(w["step_time_s"] > 0 and w["tokens_per_s"] > 0 for w in ran.windows)
    assert ran.summary is not None and ran.summary["compile_s"] > 0


def test_a_one_rank_prompt_completion_run_without_evaluations_saves_the_tokenizer_and_its_eos(
        tmp_path: Path, monkeypatch: Any) -> None:
    """In this process, a model built from scratch on prompt/completion data with its own tokenizer: the rows (of
    varying length) go through the data's collate, the model's end-of-sequence id is the tokenizer's (as the
    checkpoint's ``hf/config.json`` records it, for generation after export), the checkpoint holds the tokenizer,
    and a run with no evaluation ends with no validation loss in its summary (not an error)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    import ddptrain.train.trainer as trainer_module
    from ddptrain.data.instruct import generated_instructions
    from ddptrain.data.tokenizer import train_bpe
    from ddptrain.runtime.process_group import DistEnv
    from tests.helpers.runs import make_config

    # the summary's traced memory plan is tests/test_own_peak.py's (as without_the_planned_peak, for this test only)
    monkeypatch.setattr(trainer_module, "planned_peak", lambda *_: (None, "not traced here"))
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(100)], 300)
    tok.save_pretrained(tmp_path / "tokenizer")
    run = {**ONE_RANK,
           "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(tmp_path / "tokenizer"),
                    "num_samples": 32, "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 2},
           "train": {"steps": 2, "log_every": 1, "check_every": 1, "eval_every": 0}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
        summary = trainer_module.Trainer(make_config(str(tmp_path), run), env, torch.device("cpu"), run_dir, {}).train()
    finally:
        dist.destroy_process_group()
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [1, 2] and not any("val_loss" in w for w in windows)
    assert summary["final_val_loss"] is None and summary["final_loss"] == windows[-1]["loss"]
    hf = run_dir / "checkpoints" / "step_000002" / "hf"
    assert AutoConfig.from_pretrained(hf).eos_token_id == tok.eos_token_id is not None
    assert sorted(f.name for f in hf.glob("tokenizer*")) == ["tokenizer.json", "tokenizer_config.json"]
    assert AutoTokenizer.from_pretrained(hf).get_vocab() == tok.get_vocab()


def test_a_trainer_built_to_compile_under_hsdp_says_so_and_builds_the_model_on_its_device(
        tmp_path: Path, caplog: Any, monkeypatch: Any, request: Any) -> None:
    """Built, not trained (compilation would run at the first step), in this process on one rank: the chunked loss
    and the compilation each log their line; the model is built for the run's device (where a pretrained model's
    weights load straight to); HSDP (``parallel.shard_group=node``) lays its mesh out from the ranks per node
    with its groups timing out at ``dist.timeout_s``."""
    import logging

    import torch
    import torch.distributed as dist

    import ddptrain.train.trainer as trainer_module
    from ddptrain.runtime.process_group import DistEnv
    from tests.helpers.runs import make_config

    built: list[Any] = []
    build = trainer_module.build_model

    def recorded(*args: Any) -> Any:
        built.append(args[-1])
        return build(*args)

    monkeypatch.setattr(trainer_module, "build_model", recorded)
    # train.compile sets dynamo's process-wide settings (parallel/compile.py): put back after this test by the
    # configs' own save and load (monkeypatch's restore through setattr left dynamo's entry hidden: "does not exist")
    configs = (torch._dynamo.config, torch.compiler.config)
    saved = [config.save_config() for config in configs]
    request.addfinalizer(lambda: [c.load_config(s) for c, s in zip(configs, saved, strict=True)])
    run = {**ONE_RANK, "train": {**ONE_RANK["train"], "compile": True},
           "parallel": {"zero_stage": 3, "shard_group": "node", "wrap_single": True},
           "dist": {"timeout_s": 123}}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
        with caplog.at_level(logging.INFO, logger="ddptrain"):
            trainer = trainer_module.Trainer(make_config(str(tmp_path), run), env, torch.device("cpu"), tmp_path, {})
        trainer.sinks.close()
        mesh = next(trainer.model.parameters()).device_mesh  # FSDP2's parameters are DTensors on its mesh
        # no public getter for a group's timeout: gloo's own options (as tests/test_hsdp.py reads them)
        timeouts = [mesh.get_group(dim)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                    for dim in ("replicate", "shard")]
    finally:
        dist.destroy_process_group()
    assert built == [torch.device("cpu")]
    assert "train.compile: compiling 1 transformer blocks (on the first step)" in caplog.messages
    assert any(m.startswith("train.chunked_loss: the LM head and the loss run ") and
               m.endswith(" tokens at a time (no [tokens, vocab] logits)") for m in caplog.messages), caplog.messages
    assert mesh.mesh_dim_names == ("replicate", "shard") and mesh.mesh.tolist() == [[0]]
    assert timeouts == [123.0, 123.0]
