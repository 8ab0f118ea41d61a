"""A byte-level BPE trained on the corpus (cached), or a local pretrained tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ddptrain.errors import ConfigError

EOS = "<|endoftext|>"


def train_bpe(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
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
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
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


def cached_bpe(documents: list[str], vocab_size: int, cache: Path) -> PreTrainedTokenizerFast:
    """Train once per corpus and size; later runs (and other ranks) load the saved files."""
    if (cache / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(cache))
    tok = train_bpe(documents, vocab_size)
    tmp = cache.with_name(cache.name + ".tmp")
    tok.save_pretrained(str(tmp))
    tmp.replace(cache)
    return tok
