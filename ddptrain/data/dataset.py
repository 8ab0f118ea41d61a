"""Token data sets: documents -> token shards (cached) -> ``seq_len`` windows, split into train and validation."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ddptrain.config.choices import DataFormat
from ddptrain.config.schema import DataConfig
from ddptrain.data.corpus import Corpus, load_corpus
from ddptrain.data.prepare import ShardRecipe, is_validation, prepared_shards, refuse_in_worker
from ddptrain.data.shards import TokenWindows
from ddptrain.data.tokenizer import cached_bpe, load_tokenizer, tokenizer_fingerprint
from ddptrain.data.types import TokenData
from ddptrain.errors import ConfigError

FORMAT_VERSION = 3  # bump when the shard layout changes, to invalidate old caches
VAL_WINDOWS = 512  # data.streaming=true: validation windows read from the stream's first validation documents


def build_token_data(cfg: DataConfig) -> TokenData:
    """The data set named by ``cfg``. Real corpora are tokenized once into ``data.cache_dir`` and read from there."""
    if uses_datasets(cfg):
        from datasets import disable_progress_bars

        disable_progress_bars()
    if cfg.format == DataFormat.prompt_completion:
        from ddptrain.data.instruct import build_instruct_data

        return build_instruct_data(cfg)
    if cfg.source == "synthetic":
        return synthetic_data(cfg)
    if cfg.streaming:
        return streamed_data(cfg)
    refuse_in_worker()
    corpus = load_corpus(cfg)
    cache_root = Path(cfg.cache_dir)
    if cfg.tokenizer is None:
        bpe_dir = cache_root / f"bpe-{corpus.fingerprint}-{cfg.vocab_size}-sample{cfg.tokenizer_sample_mb:g}mb"
        tok = cached_bpe(lambda: bpe_sample(corpus, cfg), cfg.vocab_size, bpe_dir, cfg.prepare_timeout_s)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    key = hashlib.sha256(
        f"{FORMAT_VERSION}:{corpus.fingerprint}:{tokenizer_fingerprint(tok)}:{cfg.val_fraction}".encode()
    ).hexdigest()[:16]
    recipe = ShardRecipe(tok.backend_tokenizer.to_str(), len(tok), tok.eos_token_id, cfg.val_fraction,
                         cfg.shard_tokens, num_proc(cfg))
    shards = prepared_shards(cache_root / f"tokens-{key}", corpus, recipe, cfg.prepare_timeout_s)
    train, val = TokenWindows(shards["train"], cfg.seq_len), TokenWindows(shards["val"], cfg.seq_len)
    for name, split in (("train", train), ("val", val)):
        if len(split) == 0:
            raise ConfigError(
                f"data: the {name} split has fewer than data.seq_len={cfg.seq_len} tokens; use more documents "
                f"(data.max_documents) or a larger data.val_fraction"
            )
    return TokenData(train, val, len(tok), tok)


def uses_datasets(cfg: DataConfig) -> bool:
    """Whether ``cfg``'s data goes through ``datasets`` (prompt/completion rows, a stream, a hub data set). Local
    corpora are read into our own shards and synthetic data is made in memory: those runs never import it (about a
    second of every worker's start-up)."""
    return cfg.format == DataFormat.prompt_completion or cfg.streaming or cfg.source == "hub"


def streamed_data(cfg: DataConfig) -> TokenData:
    """data.streaming=true: nothing is prepared; training reads through ``StreamedBatches``, and validation is
    the first validation documents' windows (``train`` is empty here)."""
    from ddptrain.data.streaming import streamed_validation

    assert cfg.tokenizer is not None  # the schema requires one with streaming
    tok = load_tokenizer(cfg.tokenizer)
    return TokenData([], streamed_validation(cfg, tok, VAL_WINDOWS), len(tok), tok)


def num_proc(cfg: DataConfig) -> int:
    """``data.num_proc``, or the cores this process may run on."""
    return cfg.num_proc or len(os.sched_getaffinity(0))


def bpe_sample(corpus: Corpus, cfg: DataConfig) -> Iterator[str]:
    """The training documents the BPE learns from: the first ``data.tokenizer_sample_mb`` of them, read as a stream
    (validation documents are never in it)."""
    budget = cfg.tokenizer_sample_mb * 1e6
    train_docs = (t for i, t in enumerate(corpus.documents()) if not is_validation(i, cfg.val_fraction))
    for text in train_docs:
        if budget <= 0:
            return
        budget -= len(text)
        yield text


def synthetic_data(cfg: DataConfig) -> TokenData:
    """Uniform random tokens at a fixed seed: no tokenizer, no cache, for pure throughput runs."""
    rng = np.random.default_rng(0)
    n_val = max(cfg.num_samples // 50, 8)
    ids = rng.integers(0, cfg.vocab_size, size=(cfg.num_samples + n_val, cfg.seq_len), dtype=np.int64)
    rows = torch.from_numpy(ids)
    return TokenData(TokenRows(rows[: cfg.num_samples]), TokenRows(rows[cfg.num_samples :]), cfg.vocab_size, None)


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids held in memory; item ``i`` is ``{"input_ids": LongTensor[seq_len]}``, like a row of a
    packed data set (``TokenWindows``)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}
