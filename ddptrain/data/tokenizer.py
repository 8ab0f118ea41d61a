"""A byte-level BPE trained on the corpus (cached), or a local pretrained tokenizer."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ddptrain.data.cache import cache_lock, remove_stale, unique_tmp
from ddptrain.errors import ConfigError

EOS = "<|endoftext|>"


def train_bpe(documents: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): any byte sequence encodes, so code and odd characters never fail."""
    if vocab_size < 257:
        raise ConfigError(f"data.vocab_size={vocab_size}: expected at least 257 (256 bytes + end-of-text)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"data.tokenizer={path}: not a tokenizer directory ({type(exc).__name__})") from exc
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer={path}: the tokenizer has no end-of-text token")
    return tok


def tokenizer_fingerprint(tok: PreTrainedTokenizerFast) -> str:
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def cached_bpe(sample: Callable[[], Iterable[str]], vocab_size: int, cache: Path,
               timeout_s: float) -> PreTrainedTokenizerFast:
    """Train once per corpus, size and sample; later runs, other ranks and other jobs load the saved files.

    One job trains (under the entry's file lock) into a directory of its own and renames it into place; a
    job started at the same time waits and loads the result.
    """
    with cache_lock(cache, timeout_s):
        if not (cache / "tokenizer.json").is_file():
            remove_stale(cache)
            shutil.rmtree(cache, ignore_errors=True)  # no tokenizer.json: not ours, or left half-made
            tmp = unique_tmp(cache, "")
            train_bpe(sample(), vocab_size).save_pretrained(str(tmp))
            tmp.replace(cache)
    return PreTrainedTokenizerFast.from_pretrained(str(cache))
