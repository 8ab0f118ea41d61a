"""Token data sets: documents -> tokens -> packed ``seq_len`` blocks, split into train and validation, cached."""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset, disable_progress_bars, load_from_disk
from transformers import PreTrainedTokenizerBase

from ddptrain.choices import DataFormat
from ddptrain.config import DataConfig
from ddptrain.data.corpus import load_corpus
from ddptrain.data.tokenizer import cached_bpe, load_tokenizer, tokenizer_fingerprint
from ddptrain.errors import ConfigError

FORMAT_VERSION = 1  # bump when the packing changes, to invalidate old caches
log = logging.getLogger(__name__)


@dataclass
class TokenData:
    train: Dataset  # column input_ids: seq_len token ids per row
    val: Dataset
    vocab_size: int  # ids are < vocab_size
    tokenizer: PreTrainedTokenizerBase | None  # None for synthetic data
    # prompt/completion data: builds a micro batch from rows of different lengths, packed (input_ids,
    # position_ids, labels; data.packing) or padded (input_ids, attention_mask, labels); None for fixed-length
    # blocks, which batch as plain input_ids
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None


def build_token_data(cfg: DataConfig) -> TokenData:
    """The data set named by ``cfg``. Real corpora are tokenized once and reused from ``data.cache_dir``."""
    disable_progress_bars()
    if cfg.format == DataFormat.prompt_completion:
        from ddptrain.data.instruct import build_instruct_data

        return build_instruct_data(cfg)
    if cfg.source == "synthetic":
        return synthetic_data(cfg)
    corpus = load_corpus(cfg)
    train_docs, val_docs = split_documents(corpus.documents, cfg.val_fraction)
    cache_root = Path(cfg.cache_dir)
    if cfg.tokenizer is None:
        bpe_dir = _writable(cache_root) / f"bpe-{corpus.fingerprint}-{cfg.vocab_size}"
        tok = cached_bpe(train_docs, cfg.vocab_size, bpe_dir)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    key = hashlib.sha256(
        f"{FORMAT_VERSION}:{corpus.fingerprint}:{tokenizer_fingerprint(tok)}:{cfg.seq_len}:{cfg.val_fraction}".encode()
    ).hexdigest()[:16]
    target = cache_root / f"packed-{key}"
    if not (target / "DONE").is_file():
        log.info("tokenizing %d documents into %d-token blocks, cached in %s", len(corpus.documents), cfg.seq_len,
                 target)
        _write_packed(target, tok, train_docs, val_docs, cfg.seq_len)
    train, val = load_from_disk(str(target / "train")), load_from_disk(str(target / "val"))
    return TokenData(train.with_format("torch"), val.with_format("torch"), len(tok), tok)


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """A fixed, spread-out share of whole documents for validation (no block straddles the split)."""
    stride = max(2, round(1 / val_fraction))
    val = docs[stride // 2 :: stride] or docs[-1:]
    train = [d for i, d in enumerate(docs) if i % stride != stride // 2] if len(docs) > 1 else docs
    return train, val


def tokenize_batch(batch: dict[str, list[str]], tokenizer: PreTrainedTokenizerBase) -> dict[str, list[list[int]]]:
    eos = tokenizer.eos_token_id
    ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
    return {"ids": [[*x, eos] for x in ids]}


def pack_batch(batch: dict[str, list[list[int]]], seq_len: int) -> dict[str, list[list[int]]]:
    """Concatenate documents (each ended by EOS) and cut into full blocks; the short tail is dropped."""
    flat = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=np.int32)
    n = len(flat) // seq_len
    return {"input_ids": flat[: n * seq_len].reshape(n, seq_len).tolist()}


def _write_packed(
    target: Path, tok: PreTrainedTokenizerBase, train_docs: list[str], val_docs: list[str], seq_len: int
) -> None:
    tmp = _writable(target.with_name(target.name + ".tmp"))
    for name, docs in (("train", train_docs), ("val", val_docs)):
        ds = Dataset.from_dict({"text": docs})
        ds = ds.map(tokenize_batch, batched=True, remove_columns=["text"], fn_kwargs={"tokenizer": tok},
                    new_fingerprint=f"{target.name}-{name}-tok")
        ds = ds.map(pack_batch, batched=True, batch_size=2000, remove_columns=["ids"], fn_kwargs={"seq_len": seq_len},
                    new_fingerprint=f"{target.name}-{name}-pack")
        if len(ds) == 0:
            raise ConfigError(
                f"data: the {name} split has fewer than data.seq_len={seq_len} tokens; use more documents "
                f"(data.max_documents) or a larger data.val_fraction"
            )
        ds.save_to_disk(str(tmp / name))
    (tmp / "DONE").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)


def synthetic_data(cfg: DataConfig) -> TokenData:
    """Uniform random tokens at a fixed seed: no tokenizer, no cache, for pure throughput runs."""
    rng = np.random.default_rng(0)
    n_val = max(cfg.num_samples // 50, 8)
    ids = rng.integers(0, cfg.vocab_size, size=(cfg.num_samples + n_val, cfg.seq_len), dtype=np.int64)
    train = Dataset.from_dict({"input_ids": ids[: cfg.num_samples]}).with_format("torch")
    val = Dataset.from_dict({"input_ids": ids[cfg.num_samples :]}).with_format("torch")
    return TokenData(train, val, cfg.vocab_size, None)


def _writable(path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir={path.parent}: cannot create it ({exc.strerror})") from exc
    return path
