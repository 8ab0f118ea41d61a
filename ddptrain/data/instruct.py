"""Prompt/completion data for fine-tuning: one sequence per record, loss on the completion tokens only.

Records come from local JSONL/parquet files (``data.source=files``), a hub data set, or a small deterministic
set of instructions generated here (``data.source=instructions``, no download). Each is tokenized with the
model's own tokenizer (inside its chat template when it has one) and labelled -100 on the prompt. A micro batch's
examples are packed into rows of at most ``data.seq_len`` tokens (``data.packing=true``, see ``packing.py``) or
padded to the longest of them (labels -100 and attention mask 0 on padding).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import keyword
import logging
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from ddptrain.config.schema import DataConfig
from ddptrain.data.cache import cache_lock
from ddptrain.data.corpus import json_kind, records_of
from ddptrain.data.prepare import first_validation_index, is_validation
from ddptrain.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from ddptrain.data.types import IGNORE, TokenData
from ddptrain.errors import ConfigError

FORMAT_VERSION = 2  # bump when the encoding or the accepted records change, to invalidate cached rows (2: a
# record whose prompt or completion is not a string stops the run instead of being skipped)
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
    """Tokenized prompt/completion records, split into train and validation (whole records).

    Records are read as a stream and the encoded rows written to Arrow files in ``data.cache_dir`` (memory-mapped
    when read), so no list of all records is ever held; one job writes them under the entry's file lock.
    """
    assert cfg.tokenizer is not None  # validate_source refuses prompt_completion data without one
    tok = load_tokenizer(cfg.tokenizer)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, _source_fingerprint(cfg), tokenizer_fingerprint(tok),
                                     cfg.seq_len, cfg.val_fraction, cfg.chat_template, cfg.prompt_field,
                                     cfg.completion_field, cfg.max_documents]).encode()).hexdigest()[:16]
    entry = Path(cfg.cache_dir) / f"instruct-{key}"
    with cache_lock(entry, cfg.prepare_timeout_s):
        encoded = [_generated(entry, f"{key}-{split}", cfg, tok, split == "val") for split in ("train", "val")]
    if len(encoded[0]) == 0:
        raise ConfigError(f"data.seq_len={cfg.seq_len}: no record's completion fits; raise it")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if cfg.packing:
        from ddptrain.data.packing import PackCollate

        return TokenData(encoded[0], encoded[1], len(tok), tok, collate=PackCollate(pad, cfg.seq_len))
    return TokenData(encoded[0], encoded[1], len(tok), tok, collate=PadCollate(pad))


def _generated(entry: Path, fingerprint: str, cfg: DataConfig, tok: PreTrainedTokenizerBase,
               holdout: bool) -> Dataset:
    """The encoded rows of one split as an Arrow data set in ``entry``. ``datasets`` wraps an error raised while
    generating in its own ``DatasetGenerationError`` (a traceback on every rank): a bad record's one-line
    ``ConfigError`` is raised as it is."""
    from datasets.exceptions import DatasetGenerationError

    try:
        return Dataset.from_generator(_encoded_rows, cache_dir=str(entry), fingerprint=fingerprint,
                                      gen_kwargs={"cfg": cfg, "tok": tok, "holdout": holdout})
    except DatasetGenerationError as exc:
        if isinstance(exc.__cause__, ConfigError):
            raise exc.__cause__ from None
        raise


def encode(records: list[tuple[str, str]], tok: PreTrainedTokenizerBase, cfg: DataConfig) -> Dataset:
    """input_ids = prompt + completion + EOS, cut to ``data.seq_len``; labels = -100 on the prompt.

    A record whose completion does not start within ``seq_len`` tokens carries no loss and is dropped.
    """
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for prompt, completion in records:
        if (row := encode_record(prompt, completion, tok, cfg)) is not None:
            rows["input_ids"].append(row["input_ids"])
            rows["labels"].append(row["labels"])
    if dropped := len(records) - len(rows["input_ids"]):
        log.warning("%d records dropped: their prompt fills data.seq_len=%d tokens", dropped, cfg.seq_len)
    if not rows["input_ids"]:
        raise ConfigError(f"data.seq_len={cfg.seq_len}: no record's completion fits; raise it")
    return Dataset.from_dict(rows)


def encode_record(prompt: str, completion: str, tok: PreTrainedTokenizerBase,
                  cfg: DataConfig) -> dict[str, list[int]] | None:
    """One record's row (``input_ids``, ``labels``), or None when its prompt fills ``data.seq_len``."""
    if cfg.chat_template and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tok(prompt)["input_ids"]
    completion_ids = [*tok(completion, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    ids = (prompt_ids + completion_ids)[: cfg.seq_len]
    if len(prompt_ids) >= len(ids):
        return None
    return {"input_ids": ids, "labels": [IGNORE] * len(prompt_ids) + ids[len(prompt_ids) :]}


def _encoded_rows(cfg: DataConfig, tok: PreTrainedTokenizerBase, holdout: bool) -> Iterator[dict[str, list[int]]]:
    """The encoded rows of the validation (``holdout``) or training records, read as a stream. As with a list
    split by ``split_documents``: one record is both; with no validation record, the last one validates."""
    count = dropped = 0
    last: tuple[str, str] | None = None
    for index, record in enumerate(_records(cfg)):
        count, last = count + 1, record
        if is_validation(index, cfg.val_fraction) == holdout:
            row = encode_record(*record, tok, cfg)
            dropped += row is None
            if row is not None:
                yield row
    if last is None:
        raise ConfigError(f"{_what(cfg)}: no record with a non-empty {cfg.completion_field!r}")
    if holdout and count <= first_validation_index(cfg.val_fraction):
        row = encode_record(*last, tok, cfg)
        if row is not None:
            yield row
    if dropped:
        log.warning("%d records dropped: their prompt fills data.seq_len=%d tokens", dropped, cfg.seq_len)


def _what(cfg: DataConfig) -> str:
    return f"data.paths ({', '.join(cfg.paths)})" if cfg.source == "files" else f"data.name={cfg.name}"


def _source_fingerprint(cfg: DataConfig) -> str:
    if cfg.source == "instructions":
        return f"instructions:{cfg.num_samples}"
    if cfg.source == "files":
        return ";".join(f"{Path(p).absolute()}:{Path(p).stat().st_size}:{Path(p).stat().st_mtime_ns}"
                        for p in cfg.paths)
    return f"hub:{cfg.name}:{cfg.subset}:{cfg.split}"


def _records(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """The (prompt, completion) pairs with a non-empty completion, read as a stream, at most max_documents. A
    record without either field, or with one that is not a string, stops the run with one line naming where."""
    if cfg.source == "instructions":
        pairs: Iterator[tuple[str, str]] = iter(generated_instructions(cfg.num_samples))
    else:
        pairs = _field_pairs(cfg)
    return itertools.islice(((p, c) for p, c in pairs if c.strip()), cfg.max_documents)


def _field_pairs(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    fields = {"prompt_field": cfg.prompt_field, "completion_field": cfg.completion_field}
    if cfg.source == "files":
        for path in map(Path, cfg.paths):
            for where, record in records_of(path, list(fields.values())):
                yield _pair(record, fields, f"data.paths: {path}: {where}")
        return
    from datasets import load_dataset

    try:  # a hub data set is prepared as memory-mapped Arrow files: read in batches, never a whole column
        ds = load_dataset(cfg.name, cfg.subset, split=cfg.split)
    except Exception as exc:
        raise ConfigError(f"data.name={cfg.name}: cannot load the hub data set ({type(exc).__name__})") from exc
    for key, field in fields.items():
        if field not in ds.column_names:
            raise ConfigError(f"data.{key}={field!r}: not a column of {_what(cfg)}; columns: {ds.column_names}")
    number = 0
    for batch in ds.select_columns(list(fields.values())).iter(batch_size=1024):
        for prompt, completion in zip(batch[cfg.prompt_field], batch[cfg.completion_field], strict=True):
            number += 1
            yield _pair({cfg.prompt_field: prompt, cfg.completion_field: completion}, fields,
                        f"data.name={cfg.name}: record {number}")


def _pair(record: dict[str, object], fields: dict[str, str], where: str) -> tuple[str, str]:
    """The record's (prompt, completion), or the one-line error that says what ``where`` holds instead."""
    for key, field in fields.items():
        if field not in record:
            raise ConfigError(f"{where} has no {field!r} (data.{key}); expected a string there; its fields: "
                              f"{', '.join(map(str, record)) or 'none'}")
        if not isinstance(value := record[field], str):
            raise ConfigError(f"{where}: {field!r} (data.{key}) is {json_kind(value)}, expected a string")
    return record[fields["prompt_field"]], record[fields["completion_field"]]  # type: ignore[return-value]


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
