"""Every shipped experiment composes into a valid config and, shrunk to a tiny model, trains through the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from tests.helpers.cli import run_cli

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "experiment").glob("*.yaml"))
NEEDS_A_BASE = {"lora_quickstart", "qlora_4b"}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_shipped_experiment_composes_into_a_valid_config(name: str, compose: Callable[..., Config]) -> None:
    base = ["model.pretrained=/models/base"] if name in NEEDS_A_BASE else []
    compose(f"+experiment={name}", *base)


def test_a_bpe_larger_than_the_models_vocabulary_is_refused_before_any_data_is_prepared() -> None:
    layer = {"model": {"vocab_size": 32000}, "data": {"vocab_size": 32768}}
    with pytest.raises(ConfigError, match=r"^data\.vocab_size=32768 exceeds model\.vocab_size=32000: the model could "
                                          r"not embed the data's token ids"):
        build_config(layer)
    build_config(layer, {"data": {"tokenizer": "/models/tok"}})  # a tokenizer of its own: checked once loaded
    build_config(layer, {"model": {"pretrained": "/models/base"}})  # the loaded model's embeddings decide


# Each experiment shrunk to a tiny model and a few steps on 2 CPU ranks; what it ships otherwise stays.
TINY_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
              "model.intermediate_size=128"]
FEW_STEPS = ["train.steps=2", "train.log_every=1", "train.eval_every=2", "checkpoint.every_n_steps=2",
             "launch.nproc_per_node=2", "logger.progress=false"]
PRETRAIN = ["data.max_documents=40", "data.seq_len=32", "data.global_batch_size=4", "data.micro_batch_size=2"]
FINETUNE = ["data.num_samples=80", "data.seq_len=40", "data.global_batch_size=4", "data.micro_batch_size=2"]
SHRINK = {
    "quickstart": [*PRETRAIN, "data.vocab_size=512"],
    "bucket_sweep": [*PRETRAIN, "data.vocab_size=512", "parallel.bucket_cap_mb=5", "hydra.sweep.dir=sweep"],
    "gpt2_small": [*TINY_MODEL[:-1], *PRETRAIN, "data.vocab_size=512", "model.max_position_embeddings=64"],
    "llama_1b_zero3": [*TINY_MODEL, *PRETRAIN, "model.max_position_embeddings=64"],  # its own 32000-token BPE
    "lora_quickstart": FINETUNE,
    "qlora_4b": FINETUNE,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_shipped_experiment_trains_end_to_end_through_the_cli(
    name: str, pretrained_base: Path, tmp_path: Path
) -> None:
    base = [f"model.pretrained={pretrained_base}"] if name in NEEDS_A_BASE else []
    sweep = ["-m"] if name == "bucket_sweep" else []
    result = run_cli([*sweep, f"+experiment={name}", *base, *FEW_STEPS, *SHRINK[name]], cwd=tmp_path,
                     cache=tmp_path / "cache", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.parent for p in tmp_path.glob("**/summary.json"))
    assert len(runs) == 1, runs  # the sweep too: the command line's one bucket size wins over the experiment's
    assert name != "bucket_sweep" or (tmp_path / "sweep" / "sweep.md").is_file()
    for run in runs:
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2] and "val_loss" in metrics[-1]
        assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert "gemm_4bit_forward" not in result.stderr  # bitsandbytes' import noise stays out of the log
