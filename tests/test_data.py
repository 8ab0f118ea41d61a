"""Data: batch arithmetic, document split, packing, resumable sampling, and every source."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import Dataset

from ddptrain.config.compose import build_config
from ddptrain.config.schema import DataConfig
from ddptrain.data import BatchShape, MicroBatches, SampleOrder, build_token_data, validate_source
from ddptrain.data.corpus import stdlib_files
from ddptrain.data.types import split_documents
from ddptrain.errors import ConfigError


def test_grad_accum_is_derived_and_checked() -> None:
    assert BatchShape.derive(64, 4, None, 8, 128).grad_accum == 2
    assert BatchShape.derive(64, 4, 2, 8, 128).tokens_per_step == 64 * 128
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is not divisible by .*micro_batch_size=4 x dp=2 = 8"):
        BatchShape.derive(10, 4, None, 2, 128)
    with pytest.raises(ConfigError, match=r"global_batch_size=64 != .* x data.grad_accum=3 x dp=8 = 96"):
        BatchShape.derive(64, 4, 3, 8, 128)
    with pytest.raises(ConfigError, match="micro_batch_size=0"):  # the schema refuses it before any plan
        build_config({"data": {"micro_batch_size": 0}})
    assert "global batch 64 = micro batch 4 x grad accum 2 x dp 8" in BatchShape.derive(64, 4, None, 8, 16).equation()


def test_validation_documents_are_held_out_whole() -> None:
    docs = [f"doc{i}" for i in range(200)]
    train, val = split_documents(docs, 0.05)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 200
    assert split_documents(docs, 0.05) == (train, val)


def _stream(dataset: Dataset, rank: int, dp: int = 2) -> MicroBatches:
    plan = BatchShape.derive(4 * dp, 2, None, dp, 4)
    return MicroBatches(dataset, plan, rank, SampleOrder(seed=3, shuffle=True), num_workers=0,
                        device=torch.device("cpu"))


def test_the_stdlib_corpus_is_every_python_source_outside_test_and_package_folders_in_order() -> None:
    """Its folders are pruned while walking: the same files as walking everything and dropping those under a test,
    site-packages or cache folder afterwards (what it did, in 0.3 s of every run's start-up)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
    kept, dropped = [], 0
    for folder, _, names in os.walk(root):
        sources = [Path(folder, name) for name in names if name.endswith(".py")]
        if skipped & set(Path(folder).relative_to(root).parts):
            dropped += len(sources)
        else:
            kept += sources
    assert stdlib_files() == sorted(kept)
    assert root / "os.py" in kept and root / "json" / "__init__.py" in kept and dropped > 0


def test_micro_batches_resume_mid_epoch_exactly_and_reshuffle_each_epoch() -> None:
    ds = Dataset.from_dict({"input_ids": [[i] * 4 for i in range(20)]}).with_format("torch")
    straight = _stream(ds, rank=0)
    # Epochs are cut to whole global batches (16 of 20 samples): 4 batches per rank, so 12 cross two epochs.
    seen = [next(straight)[:, 0].tolist() for _ in range(12)]
    assert seen[:4] != seen[4:8], "epoch 1 must be shuffled differently from epoch 0"
    interrupted = _stream(ds, rank=0)
    first = [next(interrupted)[:, 0].tolist() for _ in range(7)]
    resumed = _stream(ds, rank=0)
    resumed.load_state_dict(interrupted.state_dict())
    assert first + [next(resumed)[:, 0].tolist() for _ in range(5)] == seen
    other = _stream(ds, rank=1)
    assert not {i for b in seen[:4] for i in b} & {i for _ in range(4) for i in next(other)[:, 0].tolist()}


def _cfg(tmp_path: Path, **kw: object) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), vocab_size=300, seq_len=16, val_fraction=0.25, **kw)


def test_local_text_jsonl_and_parquet_files_train_a_tokenizer_and_pack(tmp_path: Path) -> None:
    docs = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20 for i in range(8)]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    cases = {
        "txt": _cfg(tmp_path, source="files", paths=[str(tmp_path / f"{i}.txt") for i in range(8)]),
        "jsonl": _cfg(tmp_path, source="files", paths=[str(tmp_path / "d.jsonl")], text_field="body"),
        "parquet": _cfg(tmp_path, source="files", paths=[str(tmp_path / "d.parquet")], text_field="body"),
    }
    for name, cfg in cases.items():
        validate_source(cfg)
        data = build_token_data(cfg)
        assert len(data.train) > 0 and len(data.val) > 0, name
        assert data.train[0]["input_ids"].shape == (16,)
        ids = torch.stack([data.train[i]["input_ids"] for i in range(len(data.train))])
        assert int(ids.max()) < data.vocab_size <= 300
        assert data.tokenizer is not None and "return x" in data.tokenizer.decode(ids[:4].flatten())


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"empty\.txt: the file is empty"):
        validate_source(_cfg(tmp_path, source="files", paths=[str(tmp_path / "empty.txt")]))
    with pytest.raises(ConfigError, match=r"data.paths: .*\.csv: expected one of"):
        validate_source(_cfg(tmp_path, source="files", paths=[str(tmp_path / "a.csv")]))
    with pytest.raises(ConfigError, match=r"data\.text_field=.text.: not a column"):
        build_token_data(_cfg(tmp_path, source="files", paths=[str(tmp_path / "d.jsonl")]))


def test_synthetic_data_is_seeded_and_in_range() -> None:
    cfg = DataConfig(source="synthetic", vocab_size=50, num_samples=64, seq_len=8)
    a, b = build_token_data(cfg), build_token_data(cfg)
    ids = a.train[:]["input_ids"]
    assert torch.equal(ids, b.train[:]["input_ids"])
    assert ids.shape == (64, 8) and int(ids.max()) < 50 and a.tokenizer is None
