"""Prompt/completion data for fine-tuning: one sequence per record, loss on the completion tokens only.

Records come from local JSONL/parquet files (``data.source=files``), a hub data set, or a small deterministic
set of instructions generated here (``data.source=instructions``, no download). Each is tokenized with the
model's own tokenizer (inside its chat template when it has one) and labelled -100 on the prompt. A micro batch's
examples are packed into rows of at most ``data.seq_len`` tokens (``data.packing=true``, see ``packing.py``) or
padded to the longest of them (labels -100 and attention mask 0 on padding).
"""

from __future__ import annotations

import keyword
import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from ddptrain.config import DataConfig
from ddptrain.data.corpus import FILE_LOADERS
from ddptrain.data.dataset import TokenData, split_documents
from ddptrain.data.tokenizer import load_tokenizer
from ddptrain.errors import ConfigError, flat

IGNORE = -100  # label of a position that carries no loss (prompt, padding): torch's cross-entropy ignore_index
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PadCollate:
    """Right-pads one micro batch to its longest sequence: pad id in inputs, -100 in labels, 0 in the mask."""

    pad_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.as_tensor(row["input_ids"])
            labels[i, :n] = torch.as_tensor(row["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build_instruct_data(cfg: DataConfig) -> TokenData:
    """Tokenized prompt/completion records, split into train and validation (whole records)."""
    assert cfg.tokenizer is not None  # validate_source refuses prompt_completion data without one
    tok = load_tokenizer(cfg.tokenizer)
    records = _records(cfg)
    train, val = split_documents(records, cfg.val_fraction)  # type: ignore[arg-type]
    encoded = [encode(rows, tok, cfg) for rows in (train, val)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if cfg.packing:
        from ddptrain.data.packing import PackCollate

        return TokenData(encoded[0], encoded[1], len(tok), tok, collate=PackCollate(pad, cfg.seq_len))
    return TokenData(encoded[0], encoded[1], len(tok), tok, collate=PadCollate(pad))


def encode(records: list[tuple[str, str]], tok: PreTrainedTokenizerBase, cfg: DataConfig) -> Dataset:
    """input_ids = prompt + completion + EOS, cut to ``data.seq_len``; labels = -100 on the prompt.

    A record whose completion does not start within ``seq_len`` tokens carries no loss and is dropped.
    """
    template = cfg.chat_template and getattr(tok, "chat_template", None)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    dropped = 0
    for prompt, completion in records:
        if template:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tok(prompt)["input_ids"]
        completion_ids = [*tok(completion, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        ids = (prompt_ids + completion_ids)[: cfg.seq_len]
        if len(prompt_ids) >= len(ids):
            dropped += 1
            continue
        rows["input_ids"].append(ids)
        rows["labels"].append([IGNORE] * len(prompt_ids) + ids[len(prompt_ids) :])
    if dropped:
        log.warning("%d records dropped: their prompt fills data.seq_len=%d tokens", dropped, cfg.seq_len)
    if not rows["input_ids"]:
        raise ConfigError(f"data.seq_len={cfg.seq_len}: no record's completion fits; raise it")
    return Dataset.from_dict(rows)


def _records(cfg: DataConfig) -> list[tuple[str, str]]:
    if cfg.source == "instructions":
        return generated_instructions(cfg.num_samples)
    from datasets import load_dataset

    if cfg.source == "files":
        kind = FILE_LOADERS[Path(cfg.paths[0]).suffix.lower()]
        what = f"data.paths ({', '.join(cfg.paths)})"
        try:
            ds = load_dataset(kind, data_files=[str(Path(p).absolute()) for p in cfg.paths], split="train")
        except Exception as exc:
            raise ConfigError(f"data.paths: cannot read as {kind}: {flat(str(exc), 200)}") from exc
    else:
        what = f"data.name={cfg.name}"
        try:
            ds = load_dataset(cfg.name, cfg.subset, split=cfg.split)
        except Exception as exc:
            raise ConfigError(f"data.name={cfg.name}: cannot load the hub data set ({type(exc).__name__})") from exc
    for key in ("prompt_field", "completion_field"):
        if getattr(cfg, key) not in ds.column_names:
            raise ConfigError(f"data.{key}={getattr(cfg, key)!r}: not a column of {what}; columns: {ds.column_names}")
    pairs = zip(ds[cfg.prompt_field][: cfg.max_documents], ds[cfg.completion_field][: cfg.max_documents], strict=True)
    records = [(p, c) for p, c in pairs if isinstance(p, str) and isinstance(c, str) and c.strip()]
    if not records:
        raise ConfigError(f"{what}: no record with a non-empty {cfg.completion_field!r}")
    return records


def generated_instructions(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` deterministic instruction/answer pairs (sums, reversed and upper-cased words), no download.

    The words are Python's keywords and standard-library module names: present on every machine.
    """
    rng = random.Random(seed)
    words = sorted({*keyword.kwlist, *(m for m in sys.stdlib_module_names if m.isalpha())})
    out = []
    for _ in range(n):
        task, word = rng.randrange(3), rng.choice(words)
        if task == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            out.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
        elif task == 1:
            out.append((f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."))
        else:
            out.append((f"Write '{word}' in capitals.", f"In capitals: '{word.upper()}'."))
    return out
