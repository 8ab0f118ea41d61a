"""Corpus -> token shards in bounded memory, on every core, resumable, one writer per cache key.

The corpus is read as a stream of documents in batches of about ``BATCH_BYTES``; a pool of ``data.num_proc``
worker processes tokenizes the batches (the tokenizer's ``encode_batch`` on one thread each, as nanoGPT's and
Megatron's preprocessing do) while at most ``2 x num_proc`` batches are in flight, so memory is O(batch x
workers), whatever the corpus size. Results come back in corpus order and are appended to the train or
validation shards (whole documents, each followed by EOS). A finished shard records which documents it holds,
so an interrupted preparation continues after the last finished shard.

Every job sharing ``data.cache_dir`` (a sweep, nodes on shared storage) takes an inter-process file lock per
cache entry: the first prepares, the others wait (printing the first one's progress line) and then reuse it.
Whatever a killed writer left behind (its unfinished shard, a temporary tokenizer directory) is removed by the
next holder of the lock.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddptrain.data.cache import cache_lock, progress_path, remove_stale
from ddptrain.data.corpus import Corpus
from ddptrain.data.encode import encode_documents, start_worker
from ddptrain.data.shards import ShardInfo, ShardWriter, finished_shards, read_header, token_dtype
from ddptrain.errors import ConfigError

BATCH_BYTES = 1 << 20  # text per task sent to a worker
BATCH_DOCS = 2048
PROGRESS_EVERY_S = 10.0  # one progress line this often
WORKER_ENV = "DDPTRAIN_TOKENIZER_WORKER"  # set in the worker processes' environment
DONE = "DONE.json"  # written last: the shards listed in it are the cache entry
SPLITS = ("train", "val")
log = logging.getLogger(__name__)


def is_validation(index: int, val_fraction: float) -> bool:
    """Whether document ``index`` of the corpus stream is held out: a fixed, spread-out share of whole
    documents, decided without knowing how many documents follow."""
    stride = max(2, round(1 / val_fraction))
    return index % stride == stride // 2


def first_validation_index(val_fraction: float) -> int:
    """The first index ``is_validation`` holds out: a stream no longer than this has no validation document."""
    return max(2, round(1 / val_fraction)) // 2


@dataclass(frozen=True)
class ShardRecipe:
    """How a corpus becomes token shards: the tokenizer (its JSON, vocabulary size and EOS id), the held-out
    share, the tokens per shard and the tokenizing processes."""

    tokenizer_json: str
    vocab_size: int
    eos: int
    val_fraction: float
    shard_tokens: int
    num_proc: int


def prepared_shards(target: Path, corpus: Corpus, recipe: ShardRecipe, timeout_s: float
                    ) -> dict[str, list[ShardInfo]]:
    """The train and validation shards of ``target``, preparing (or finishing) them first unless done."""
    refuse_in_worker()
    with cache_lock(target, timeout_s):
        if not (target / DONE).is_file():
            remove_stale(target)
            _prepare(target, corpus, recipe)
    return load_manifest(target)


def load_manifest(target: Path) -> dict[str, list[ShardInfo]]:
    """The shards ``DONE.json`` lists, each header checked against its file (truncation, corruption)."""
    try:
        manifest = json.loads((target / DONE).read_text())
        names = {split: manifest[split] for split in SPLITS}
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"token cache {target / DONE}: unreadable ({type(exc).__name__}); delete {target} to "
                          "prepare it again") from exc
    shards = {split: [read_header(target / name) for name in names[split]] for split in SPLITS}
    for split, listed in zip(SPLITS, (manifest["train_tokens"], manifest["val_tokens"]), strict=True):
        if sum(s.tokens for s in shards[split]) != listed:
            raise ConfigError(f"token cache {target / DONE}: the {split} shards hold other token counts than it "
                              f"lists; delete {target} to prepare it again")
    return shards


def _prepare(target: Path, corpus: Corpus, recipe: ShardRecipe) -> None:
    tokenizer_json, vocab_size, eos = recipe.tokenizer_json, recipe.vocab_size, recipe.eos
    val_fraction, shard_tokens, num_proc = recipe.val_fraction, recipe.shard_tokens, recipe.num_proc
    target.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    writers = {}
    for split in SPLITS:
        done = finished_shards(target, split)
        writers[split] = ShardWriter(target, split, dtype, eos, shard_tokens, len(done),
                                     done[-1].end_document if done else 0)
    # Each split continues after its own last finished shard: a document before that is read again but not
    # encoded again. (The validation split finishes a shard about 1/val_fraction times less often than the train
    # split, so continuing both from the earlier of the two would encode most finished train shards again.)
    resume = {split: w.next_document for split, w in writers.items()}

    def unfinished(index: int) -> bool:
        return index >= resume["val" if is_validation(index, val_fraction) else "train"]

    if any(w.index for w in writers.values()):
        log.info("continuing the preparation of %s: %d train shards (documents before %d) and %d validation shards "
                 "(before %d) were finished", target, writers["train"].index, writers["train"].next_document,
                 writers["val"].index, writers["val"].next_document)
    progress = Progress(target, corpus.size_hint)
    batches, num_proc = _pool_size(_batches(corpus, unfinished, progress), num_proc)
    if num_proc > 1:
        log.info("preparing %s on %d worker processes: about %.0f MB of text", target, num_proc,
                 corpus.size_hint / 1e6)
    else:
        log.info("preparing %s in this process: about %.0f MB of text", target, corpus.size_hint / 1e6)
    try:
        for indices, texts, (tokens, lengths) in _tokenized(batches, tokenizer_json, eos, dtype, num_proc):
            ends = np.cumsum(lengths)
            for k, index in enumerate(indices):
                writer = writers["val" if is_validation(index, val_fraction) else "train"]
                if index >= writer.next_document:  # earlier ones are in a shard finished before an interruption
                    writer.add(tokens[ends[k] - lengths[k] : ends[k]], 1, index, index + 1)
            progress.advance(texts)
        for writer in writers.values():
            writer.finish()
    except BaseException:
        for writer in writers.values():
            writer.abandon()
        raise
    shards = {split: finished_shards(target, split) for split in SPLITS}
    if not shards["train"] and not shards["val"] and progress.documents == 0 and not any(resume.values()):
        raise ConfigError("data: the corpus has no non-empty document")
    manifest = {split: [s.path.name for s in shards[split]] for split in SPLITS}
    manifest.update(train_tokens=sum(s.tokens for s in shards["train"]),
                    val_tokens=sum(s.tokens for s in shards["val"]), dtype=dtype.name, eos=eos)
    tmp = target / f".{DONE}.{os.getpid()}.tmp"  # removed by remove_stale if killed here
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(target / DONE)
    progress.finish()


def _batches(corpus: Corpus, wanted: Callable[[int], bool], progress: Progress
             ) -> Iterator[tuple[list[int], list[str]]]:
    """``(documents' indices in the corpus, texts)`` batches of about ``BATCH_BYTES`` of the ``wanted`` documents."""
    batch: list[str] = []
    indices: list[int] = []
    size = 0
    for index, text in enumerate(corpus.documents()):
        if not wanted(index):
            progress.skipped(text)
            continue
        batch.append(text)
        indices.append(index)
        size += len(text)
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield indices, batch
            indices, batch, size = [], [], 0
    if batch:
        yield indices, batch


def _pool_size(batches: Iterator[tuple[list[int], list[str]]], num_proc: int
               ) -> tuple[Iterator[tuple[list[int], list[str]]], int]:
    """The batches (unchanged) and how many worker processes tokenize them: ``num_proc``, or 1 (this process) where
    a pool cannot start (a daemonic process) or cannot pay: text for one batch at most. A pool's worker is a
    spawned interpreter that imports the tokenizer's libraries, and one batch keeps only one of them busy anyway:
    2,000 documents (one batch, 271 KB of JSON Lines) took 4.6 CPU s to prepare with a pool of 2 and 0.34 in
    this process (docs/benchmarks.md, scripts/bench_small_corpus.py). Two batches are read ahead to know; a
    larger corpus gets its pool."""
    if num_proc <= 1:
        return batches, 1
    if multiprocessing.current_process().daemon:
        log.info("data.num_proc=%d: this process is daemonic and cannot start workers; tokenizing in it", num_proc)
        return batches, 1
    ahead = list(itertools.islice(batches, 2))
    return itertools.chain(ahead, batches), num_proc if len(ahead) > 1 else 1


def _tokenized(batches: Iterator[tuple[list[int], list[str]]], tokenizer_json: str, eos: int, dtype: np.dtype,
               num_proc: int) -> Iterator[tuple[list[int], list[str], tuple[np.ndarray, np.ndarray]]]:
    """Each batch with its tokens, in order; ``num_proc`` > 1 tokenizes in that many worker processes with a
    bounded number of batches in flight (an executor's ``map`` would read the whole corpus ahead)."""
    if num_proc <= 1:
        start_worker(tokenizer_json, eos, in_pool=False)
        for indices, texts in batches:
            yield indices, texts, encode_documents(texts, dtype.str)
        return
    # spawn: a fork would copy this process's threads (the process group's, the tokenizer's thread pool). A
    # spawned process imports the parent's main module again; WORKER_ENV makes a second preparation there fail
    # loudly (an unguarded script) instead of waiting on the lock this process holds.
    os.environ[WORKER_ENV] = "1"
    try:
        with ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=start_worker, initargs=(tokenizer_json, eos)) as pool:
            try:
                yield from _in_order(batches, pool, dtype, num_proc)
            except BaseException:  # Ctrl-C, an error, or the caller stopping: the queued batches are not started
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        os.environ.pop(WORKER_ENV, None)


def _in_order(batches: Iterator[tuple[list[int], list[str]]], pool: ProcessPoolExecutor, dtype: np.dtype,
              num_proc: int) -> Iterator[tuple[list[int], list[str], tuple[np.ndarray, np.ndarray]]]:
    """The pool's results in corpus order, at most ``2 x num_proc`` batches in flight."""
    pending: deque[tuple[list[int], list[str], Future]] = deque()
    for indices, texts in batches:
        pending.append((indices, texts, pool.submit(encode_documents, texts, dtype.str)))
        if len(pending) >= 2 * num_proc:
            done_indices, done_texts, future = pending.popleft()
            yield done_indices, done_texts, future.result()
    while pending:
        done_indices, done_texts, future = pending.popleft()
        yield done_indices, done_texts, future.result()


def refuse_in_worker() -> None:
    """Preparing data inside a tokenizer worker means the main module ran again there (no ``__main__`` guard)."""
    if os.environ.get(WORKER_ENV):
        raise RuntimeError("data preparation started inside a tokenizer worker process: the script that prepares "
                           "data must guard its entry point with `if __name__ == \"__main__\":` (workers are "
                           "spawned and import it again)")


class Progress:
    """One line every ``PROGRESS_EVERY_S`` (MB done, MB/s, ETA), logged here and written beside the cache entry
    for jobs waiting on its lock."""

    def __init__(self, target: Path, size_hint: int) -> None:
        self.path = progress_path(target)
        self.size_hint = size_hint
        self.done = self.documents = 0
        self.start = self.last = time.monotonic()
        self.rate_from = 0  # bytes skipped on a resume do not count towards the rate

    def skipped(self, text: str) -> None:
        self.done += len(text)
        self.rate_from = self.done

    def advance(self, texts: list[str]) -> None:
        self.done += sum(len(t) for t in texts)
        self.documents += len(texts)
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            line = self.line(now)
            log.info("preparing: %s", line)
            self.path.write_text(line + "\n")

    def line(self, now: float) -> str:
        rate = (self.done - self.rate_from) / max(now - self.start, 1e-9)
        left = max(self.size_hint - self.done, 0)
        eta = f", ETA {left / rate / 60:.1f} min" if self.size_hint and rate > 0 else ""
        return f"{self.done / 1e6:.0f} of ~{self.size_hint / 1e6:.0f} MB, {rate / 1e6:.1f} MB/s{eta}"

    def finish(self) -> None:
        log.info("prepared: %s", self.line(time.monotonic()).split(", ETA")[0])
        self.path.unlink(missing_ok=True)
