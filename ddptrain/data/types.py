"""What the data path hands to training: token data sets and the validation split rule, shared by the pretraining
(``dataset``) and prompt/completion (``instruct``) builders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddptrain.data.prepare import is_validation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100  # label of a position that carries no loss (prompt, padding): torch's cross-entropy ignore_index


@dataclass
class TokenData:
    train: Any  # a map-style data set: item i is {"input_ids": seq_len ids} (packed) or a prompt/completion row
    val: Any
    vocab_size: int  # ids are < vocab_size
    tokenizer: PreTrainedTokenizerBase | None  # None for synthetic data
    # prompt/completion data: builds a micro batch from rows of different lengths, packed (input_ids,
    # position_ids, labels; data.packing) or padded (input_ids, attention_mask, labels); None for fixed-length
    # blocks, which batch as plain input_ids
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None


def split_documents(docs: list[Any], val_fraction: float) -> tuple[list[Any], list[Any]]:
    """A fixed, spread-out share of whole documents for validation (the rule ``prepare`` applies to a stream)."""
    if len(docs) < 2:
        return docs, docs
    val = [d for i, d in enumerate(docs) if is_validation(i, val_fraction)] or docs[-1:]
    train = [d for i, d in enumerate(docs) if not is_validation(i, val_fraction)]
    return train, val
