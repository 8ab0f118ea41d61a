"""Preparing a corpus into token shards: exact contents, bounded tokenizer sample, resume, shared caches, damage."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from ddptrain.config.schema import DataConfig
from ddptrain.data import BatchShape, build_token_data
from ddptrain.data import dataset as dataset_module
from ddptrain.data import prepare as prepare_module
from ddptrain.data.corpus import Corpus
from ddptrain.data.encode import encode_documents
from ddptrain.data.instruct import encode, generated_instructions
from ddptrain.data.loader import MicroBatches, SampleOrder
from ddptrain.data.prepare import DONE, ShardRecipe, is_validation, prepared_shards
from ddptrain.data.shards import HEADER_BYTES, check_shard, finished_shards, open_tokens
from ddptrain.data.streaming import StreamedBatches
from ddptrain.data.tokenizer import train_bpe
from ddptrain.data.types import split_documents
from ddptrain.errors import ConfigError
from tests.helpers import procs
from tests.helpers.cli import DDPTRAIN, test_env
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each, without_token_count
from tests.helpers.tiny import TINY_MODEL

DOCS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" * (1 + i % 5) for i in range(120)]


def _jsonl(tmp_path: Path, docs: list[str] = DOCS) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _cfg(tmp_path: Path, **kw: object) -> DataConfig:
    base = {"source": "files", "paths": [str(_jsonl(tmp_path))], "cache_dir": str(tmp_path / "cache"),
            "vocab_size": 300, "seq_len": 16, "val_fraction": 0.1, "shard_tokens": 500}
    return DataConfig(**{**base, **kw})  # type: ignore[arg-type]


def _split_tokens(shards: list) -> np.ndarray:
    return np.concatenate([np.asarray(open_tokens(s)) for s in shards])


def test_shards_hold_every_documents_ids_followed_by_eos_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ddptrain.data.prepare.BATCH_DOCS", 16)  # several batches: a pool is worth starting
    cfg = _cfg(tmp_path, num_proc=2)
    with caplog.at_level(logging.INFO, logger="ddptrain.data.prepare"):
        data = build_token_data(cfg)
    assert "on 2 worker processes" in caplog.text  # the pool tokenized, not this process
    tok = data.tokenizer
    target = next((tmp_path / "cache").glob("tokens-*/DONE.json")).parent
    for split, wanted_docs in (("train", [d for i, d in enumerate(DOCS) if not is_validation(i, 0.1)]),
                               ("val", [d for i, d in enumerate(DOCS) if is_validation(i, 0.1)])):
        shards = finished_shards(target, split)
        expected = [t for d in wanted_docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
        assert _split_tokens(shards).tolist() == expected, split
        assert all(s.itemsize == 2 for s in shards)  # a 300-token vocabulary fits uint16
        assert sum(s.documents for s in shards) == len(wanted_docs)
    assert len(finished_shards(target, "train")) > 2  # shard_tokens=500 cut the train split into several
    # seq_len windows are consecutive slices of each shard; the data set pickles without its memory maps
    windows = data.train
    first = np.asarray(open_tokens(windows.shards[0]))
    assert windows[1]["input_ids"].tolist() == first[16:32].tolist()
    assert len(windows) == sum(s.tokens // 16 for s in windows.shards)
    assert len(pickle.dumps(windows)) < 4096


def test_a_corpus_prepared_with_one_or_several_workers_gives_the_same_shards(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ddptrain.data.prepare.BATCH_DOCS", 16)  # several batches: the pool runs
    one = build_token_data(_cfg(tmp_path, num_proc=1, cache_dir=str(tmp_path / "a")))
    with caplog.at_level(logging.INFO, logger="ddptrain.data.prepare"):
        two = build_token_data(_cfg(tmp_path, num_proc=2, cache_dir=str(tmp_path / "b")))
    assert "on 2 worker processes" in caplog.text
    assert _split_tokens(one.train.shards).tolist() == _split_tokens(two.train.shards).tolist()


@pytest.mark.parametrize("batch_docs", [len(DOCS), len(DOCS) - 1], ids=["one-batch", "two-batches"])
def test_a_pool_is_started_only_for_more_than_one_batch_of_text(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, batch_docs: int,
) -> None:
    """A corpus of one batch is tokenized in this process whatever ``data.num_proc`` says (a pool's spawned
    workers would cost more than the batch, and only one would work); one more document than a batch holds
    starts the pool. The shards are the same either way."""
    monkeypatch.setattr("ddptrain.data.prepare.BATCH_DOCS", batch_docs)
    pools: list[int] = []
    real_pool = prepare_module.ProcessPoolExecutor

    def counted(workers: int, **kwargs: object) -> concurrent.futures.ProcessPoolExecutor:
        pools.append(workers)
        return real_pool(workers, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prepare_module, "ProcessPoolExecutor", counted)
    with caplog.at_level(logging.INFO, logger="ddptrain.data.prepare"):
        data = build_token_data(_cfg(tmp_path, num_proc=2))
    one_batch = batch_docs == len(DOCS)
    assert pools == ([] if one_batch else [2])
    assert ("in this process" in caplog.text, "on 2 worker processes" in caplog.text) == (one_batch, not one_batch)
    tok = data.tokenizer
    expected = [t for i, d in enumerate(DOCS) if not is_validation(i, 0.1)
                for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    assert _split_tokens(data.train.shards).tolist() == expected


def test_a_daemonic_process_tokenizes_in_itself_even_where_a_pool_would_pay(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A daemonic process (a multiprocessing or DataLoader worker) cannot start a pool's children: with more than
    one batch and ``data.num_proc=2`` it still tokenizes in itself, says why, and loses no batch; the same batches
    in a process that is not daemonic get the pool (what the daemonic check turns off)."""
    batches = [([0], ["a"]), ([1], ["b"]), ([2], ["c"])]
    kept, workers = prepare_module._pool_size(iter(batches), 2)
    assert workers == 2 and list(kept) == batches
    daemonic = SimpleNamespace(daemon=True, name="daemonic")  # ``name``: logging records the process's
    monkeypatch.setattr(prepare_module.multiprocessing, "current_process", lambda: daemonic)
    with caplog.at_level(logging.INFO, logger="ddptrain.data.prepare"):
        kept, workers = prepare_module._pool_size(iter(batches), 2)
    assert workers == 1 and list(kept) == batches
    assert "this process is daemonic and cannot start workers" in caplog.text


def _interrupted(documents: list[str], after: int) -> Iterator[str]:
    for i, doc in enumerate(documents):
        if i == after:
            raise KeyboardInterrupt
        yield doc


def test_an_interrupted_preparation_resumes_after_its_last_finished_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ddptrain.data.prepare.BATCH_DOCS", 8)  # small batches: shards finish before the stop
    tok = train_bpe(DOCS, 300)
    args = (ShardRecipe(tok.backend_tokenizer.to_str(), len(tok), tok.eos_token_id, 0.1, 500, 1), 60.0)
    full = Corpus(lambda: iter(DOCS), "fp", 0)
    reference = prepared_shards(tmp_path / "reference", full, *args)

    target = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepared_shards(target, Corpus(lambda: _interrupted(DOCS, 90), "fp", 0), *args)
    kept = finished_shards(target, "train")
    assert kept and not (target / DONE).exists()
    assert list(target.glob(".*.tmp")) == []  # the unfinished shard is not left behind
    (target / ".train-00099.4242-deadbeef.tmp").write_bytes(b"a killed writer's leftover")
    stamps = {s.path: s.path.stat().st_mtime_ns for s in kept}
    read: list[int] = []

    def counted() -> Iterator[str]:
        for i, doc in enumerate(DOCS):
            read.append(i)
            yield doc

    encoded: list[str] = []

    def encode_counted(texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
        encoded.extend(texts)
        return encode_documents(texts, dtype)

    # a document before its split's last finished shard is in that shard: read again, not encoded again
    done_before = {split: shards[-1].end_document if (shards := finished_shards(target, split)) else 0
                   for split in ("train", "val")}
    assert done_before["train"] > 0
    unfinished = [d for i, d in enumerate(DOCS) if i >= done_before["val" if is_validation(i, 0.1) else "train"]]
    monkeypatch.setattr("ddptrain.data.prepare.encode_documents", encode_counted)  # num_proc=1: in this process
    with caplog.at_level(logging.INFO, logger="ddptrain.data.prepare"):
        resumed = prepared_shards(target, Corpus(counted, "fp", 0), *args)
    assert "continuing the preparation" in caplog.text
    assert read[0] == 0 and len(read) == len(DOCS)  # skipped documents are read again, not tokenized again
    assert encoded == unfinished  # counted where the tokenizer runs
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # finished shards were not written again
    assert list(target.glob(".*.tmp")) == []
    for split in ("train", "val"):
        assert [s.path.read_bytes() for s in resumed[split]] == [s.path.read_bytes() for s in reference[split]]


def test_the_bpe_learns_from_a_bounded_sample_of_training_documents(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def recording(documents: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
        docs = list(documents)
        seen.extend(docs)
        return train_bpe(docs, vocab_size)

    monkeypatch.setattr("ddptrain.data.tokenizer.train_bpe", recording)
    build_token_data(_cfg(tmp_path, tokenizer_sample_mb=0.001))  # 1000 characters
    val = {d for i, d in enumerate(DOCS) if is_validation(i, 0.1)}
    assert seen and sum(len(d) for d in seen[:-1]) < 1000 and len(seen) < len(DOCS) // 4
    assert not val & set(seen)
    assert any(p.name.endswith("sample0.001mb") for p in (tmp_path / "cache").iterdir())


def test_a_truncated_or_corrupt_shard_is_a_one_line_error_naming_the_file(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    build_token_data(cfg)
    shard = sorted((tmp_path / "cache").glob("tokens-*/train-00001.bin"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-6])
    with pytest.raises(ConfigError, match=rf"token shard {shard}: truncated or corrupt") as exc:
        build_token_data(cfg)
    assert "\n" not in str(exc.value)
    shard.write_bytes(b"garbage!" + data[8:])
    with pytest.raises(ConfigError, match=rf"token shard {shard}: not a ddptrain token shard"):
        build_token_data(cfg)


def _flip(path: Path, at: int) -> None:
    """Damage a file in place, without changing its size."""
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def test_a_shard_damaged_in_place_is_a_one_line_error_naming_the_file_when_its_block_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same size, flipped bits: the header and size checks cannot see it, the per-block checksums do."""
    # blocks of 48 bytes (24 uint16 tokens): windows of 16 tokens straddle two blocks every other time
    monkeypatch.setattr("ddptrain.data.shards.CHECK_BLOCK", 48)
    cfg = _cfg(tmp_path)
    intact = build_token_data(cfg)
    shard = intact.train.shards[0]
    assert shard.block_bytes == 48 and shard.blocks > 8
    assert [intact.train[i]["input_ids"].shape for i in range(6)] == [torch.Size([16])] * 6  # tokens 0-95
    assert intact.train.opened(0)[2].tolist()[:5] == [True, True, True, True, False]  # read blocks were checked
    check_shard(shard)

    _flip(shard.path, HEADER_BYTES + 5 * 48 + 2)  # block 5 (tokens 120-143): in window 7 (tokens 112-127)
    damaged = build_token_data(cfg)  # start-up reads no token data
    assert [damaged.train[i]["input_ids"].shape for i in range(7)] == [torch.Size([16])] * 7  # blocks 0-4 are whole
    bytes_named = rf"token shard {shard.path}: corrupt \(bytes {HEADER_BYTES + 240}-{HEADER_BYTES + 287} do not match"
    with pytest.raises(ConfigError, match=bytes_named) as exc:
        damaged.train[7]  # its first block (4) is whole, its second is not
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=bytes_named):
        check_shard(shard)
    # read by a DataLoader worker process, the error is still one line (not torch's wrapped traceback)
    before = set(psutil.Process().children())
    batches = MicroBatches(damaged.train, BatchShape.derive(2, 2, None, 1, 16), 0, SampleOrder(0, False), 1,
                           torch.device("cpu"))
    next(batches)  # windows 0-1: whole
    workers = set(psutil.Process().children()) - before
    assert workers  # the loader's worker process
    with pytest.raises(ConfigError, match=bytes_named) as exc:
        for _ in range(len(damaged.train)):
            next(batches)
    assert "\n" not in str(exc.value)
    # the worker ends with the error, not when the garbage collector finds the loader (that waited 5 s, torch's
    # join timeout, in whichever later test collected it)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    # a damaged checksum table is damage too
    _flip(shard.path, HEADER_BYTES + 5 * 48 + 2)
    _flip(shard.path, HEADER_BYTES + shard.token_bytes)
    with pytest.raises(ConfigError, match=rf"token shard {shard.path}: corrupt \(bytes {HEADER_BYTES}-"):
        build_token_data(cfg).train[0]


def test_a_stale_temporary_of_a_killed_job_is_cleaned_up(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / f"bpe-{dataset_module.load_corpus(cfg).fingerprint}-300-sample64mb.tmp-999-abcdef01"
    stale.mkdir()
    (stale / "tokenizer.json").write_text("{}")
    build_token_data(cfg)
    assert not stale.exists()
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]


def _prepare_at_once(rank: int, world_size: int, corpus: str, cache: str) -> tuple[str, list[str]]:
    """For ``run_distributed``: every rank prepares the same new corpus into one cache at the same moment, as
    separate jobs would (the group serves only to start them together); what it got and what it logged."""
    import torch.distributed as dist

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    dist.barrier()
    cfg = DataConfig(source="files", paths=[corpus], cache_dir=cache, vocab_size=300, seq_len=16, val_fraction=0.1)
    data = build_token_data(cfg)
    return f"ok {len(data.train)} {int(data.train[0]['input_ids'].sum())}", logged


def test_jobs_preparing_the_same_new_corpus_at_once_share_one_cache(tmp_path: Path) -> None:
    """Three jobs start together on one new corpus and one cache: all get the same data, nothing is left over.
    (Before the lock, the tokenizer's shared temporary directory made all but one crash.) The jobs are forked
    ranks: processes of their own, without three interpreters' imports."""
    corpus = _jsonl(tmp_path, [d * 30 for d in DOCS])
    cache = tmp_path / "cache"
    outs = run_distributed(_prepare_at_once, 3, str(corpus), str(cache), timeout=300)
    assert len({out for out, _ in outs}) == 1 and outs[0][0].startswith("ok")
    assert len(list(cache.glob("tokens-*/DONE.json"))) == 1 and len(list(cache.glob("bpe-*/tokenizer.json"))) == 1
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]
    # one job prepared, the others waited for it and reused its shards
    assert sum(line.count("prepared:") for _, logged in outs for line in logged) == 1


@pytest.mark.slow
def test_two_training_jobs_started_together_on_a_new_corpus_both_train_from_one_shared_cache(tmp_path: Path) -> None:
    """The real command, twice at once (as a sweep submits jobs): the BPE and the shards are built once, both
    jobs train on them and see the same data (equal losses)."""
    corpus = _jsonl(tmp_path, [d * 30 for d in DOCS])
    cache = tmp_path / "cache"
    args = ["data=files", f"data.paths=[{corpus}]", "data.vocab_size=300", "data.seq_len=32",
            "data.global_batch_size=4", "data.micro_batch_size=2", "train.steps=2", "train.log_every=1",
            "train.eval_every=0"]
    jobs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        jobs.append(procs.start([*DDPTRAIN, *args], cwd=tmp_path / name, env=test_env(cache),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL))
    outs = [job.communicate(timeout=600)[0] for job in jobs]
    for job, out in zip(jobs, outs, strict=True):
        assert job.returncode == 0, out[-3000:]
    assert len(list(cache.glob("tokens-*/DONE.json"))) == 1 and len(list(cache.glob("bpe-*/tokenizer.json"))) == 1
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]
    assert sum(out.count("prepared:") for out in outs) == 1  # one job prepared, the other waited and reused it
    losses = [[json.loads(line)["loss"] for line in next((tmp_path / name).glob("outputs/*/metrics.jsonl"))
               .read_text().splitlines() if "loss" in line] for name in ("first", "second")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def _streamed(tmp_path: Path, rank: int = 0, dp: int = 1) -> StreamedBatches:
    tok_dir = tmp_path / "tok"
    if not tok_dir.is_dir():
        train_bpe(DOCS, 300).save_pretrained(str(tok_dir))
    small = tmp_path / "small" / "corpus.jsonl"
    if not small.is_file():
        small.parent.mkdir()
        _jsonl(small.parent, DOCS[:24])
    cfg = _cfg(tmp_path, streaming=True, tokenizer=str(tok_dir), paths=[str(small)])
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    return StreamedBatches(cfg, tok, BatchShape.derive(2 * dp, 2, None, dp, 16), rank, torch.device("cpu"))


def test_a_streamed_run_resumes_exactly_on_the_same_world_size_and_refuses_another(tmp_path: Path) -> None:
    straight = _streamed(tmp_path)
    seen = [next(straight) for _ in range(40)]
    assert straight.epoch == 1  # 1280 tokens: past the first epoch (about 1000 training tokens)
    interrupted = _streamed(tmp_path)
    first = [next(interrupted) for _ in range(13)]
    state = interrupted.state_dict()
    assert json.loads(state["stream"])[0]["pending"]  # a document's tokens are split over the checkpoint
    resumed = _streamed(tmp_path)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain ints and strings survive any serializer
    rest = [next(resumed) for _ in range(27)]
    assert all(torch.equal(a, b) for a, b in zip(first + rest, seen, strict=True))
    # the windows are the documents' ids each followed by EOS, in stream order (validation documents held out)
    tok = resumed.tok
    train_docs = [d for i, d in enumerate(DOCS[:24]) if not is_validation(i, 0.1)]
    ids = [t for d in train_docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    assert torch.cat([b.flatten() for b in seen[:10]]).tolist() == ids[: 10 * 32]
    with pytest.raises(ConfigError, match=r"reader positions are for 1 ranks and this run has 2; .* resume on 1"):
        _streamed(tmp_path, rank=0, dp=2).load_state_dict(state)


def test_a_streamed_checkpoint_without_a_token_count_resumes_at_steps_times_tokens_per_step(tmp_path: Path) -> None:
    """A streamed checkpoint of an earlier version has no ``tokens_seen`` in its data state: loading it leaves the
    count unknown (None, not 0), so the trainer's fallback runs and the count resumes at the steps done x the
    tokens per step (fixed windows: every position a real token), as the uninterrupted stream counts."""
    from types import SimpleNamespace

    from ddptrain.train.trainer import Trainer

    straight, steps = _streamed(tmp_path), 3
    for _ in range(steps):
        next(straight)  # one micro batch per step here (global batch 2 = micro batch 2 x 1 rank)
    state = json.loads(json.dumps(straight.state_dict()))
    assert state.pop("tokens_seen") == steps * straight.shape.tokens_per_step  # an earlier version's: no count
    resumed = _streamed(tmp_path)
    resumed.load_state_dict(state)
    assert resumed.tokens_seen is None
    Trainer._continue_token_count(SimpleNamespace(batches=resumed, start=steps, shape=resumed.shape))  # type: ignore[arg-type]
    assert resumed.tokens_seen == steps * resumed.shape.tokens_per_step == straight.tokens_seen
    next(resumed), next(straight)
    assert resumed.tokens_seen == straight.tokens_seen == (steps + 1) * straight.shape.tokens_per_step


def test_the_streaming_position_on_two_ranks_advances_by_the_micro_batch_times_the_ranks(tmp_path: Path) -> None:
    """``position`` counts the global windows all ranks consumed (as ``MicroBatches`` does): each rank's micro batch
    of 2 windows moves it by 2 x 2 on 2 ranks, while each rank reads its own half of the stream."""
    ranks = [_streamed(tmp_path, rank=r, dp=2) for r in range(2)]
    drawn = [[next(stream) for _ in range(3)] for stream in ranks]
    assert [stream.position for stream in ranks] == [3 * 2 * 2] * 2
    assert all(stream.epoch == 0 for stream in ranks)  # still the first epoch: no reset of the position
    assert not any(torch.equal(a, b) for a, b in zip(*drawn, strict=True))  # two different parts of the stream


@pytest.mark.slow
def test_a_streamed_training_run_resumed_from_its_checkpoint_continues_bitwise(tmp_path: Path) -> None:
    """Through the real loop and checkpoint on 2 ranks: the resumed run's losses equal the uninterrupted run's, and
    its token count continues, also from a checkpoint of a version that did not record the count (derived from the
    steps: fixed windows)."""
    tok_dir = tmp_path / "tok"
    train_bpe(DOCS, 300).save_pretrained(str(tok_dir))
    base = {
        "model": TINY_MODEL,
        "data": {"source": "files", "paths": [str(_jsonl(tmp_path))], "streaming": True, "tokenizer": str(tok_dir),
                 "seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "val_fraction": 0.1},
        "train": {"steps": 4, "log_every": 1, "eval_every": 2},
        "checkpoint": {"every_n_steps": 2},
    }
    (first,) = run_distributed(train_each, 2, str(tmp_path / "straight"), base, [{}])[0]
    checkpoint = Path(first["dir"]) / "checkpoints" / "step_000002"
    assert without_token_count(checkpoint, tmp_path / "earlier" / checkpoint.name) == 2 * 8 * 32
    resumed_from = [{"train": {"resume": str(path)}} for path in (checkpoint, tmp_path / "earlier" / checkpoint.name)]
    runs = [first, *run_distributed(train_each, 2, str(tmp_path / "resumed"), base, resumed_from)[0]]
    straight, resumed, earlier = ([m["loss"] for m in run["metrics"] if "loss" in m] for run in runs)
    assert len(straight) == 4 and straight[2:] == resumed == earlier
    seen = [[m["tokens_seen"] for m in run["metrics"] if "loss" in m] for run in runs]
    assert seen[0] == [8 * 32 * step for step in (1, 2, 3, 4)]  # fixed windows of 32
    assert seen[1] == seen[2] == seen[0][2:]


def test_prompt_completion_records_stream_into_cached_rows_equal_to_encoding_the_list(tmp_path: Path) -> None:
    records = generated_instructions(120)
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"q": p, "a": c}) + "\n" for p, c in records))
    pq.write_table(pa.table({"q": [p for p, _ in records], "a": [c for _, c in records]}), tmp_path / "pc.parquet")
    tok_dir = tmp_path / "tok"
    train_bpe([f"{p} {c}" for p, c in records], 320).save_pretrained(str(tok_dir))
    for name in ("pc.jsonl", "pc.parquet"):
        cfg = DataConfig(source="files", paths=[str(tmp_path / name)], format="prompt_completion", prompt_field="q",
                         completion_field="a", tokenizer=str(tok_dir), cache_dir=str(tmp_path / "cache"),
                         seq_len=24, val_fraction=0.1)
        data = build_token_data(cfg)
        assert data.train.cache_files  # Arrow files in data.cache_dir, memory-mapped: not rows held in memory
        train, val = split_documents(records, 0.1)
        tok = data.tokenizer
        for got, want in ((data.train, encode(train, tok, cfg)), (data.val, encode(val, tok, cfg))):
            assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"], name
