"""``data.streaming=true``: tokenize and pack on the fly, for data sets too large (or too remote) to prepare.

The documents come from a ``datasets`` streaming data set (local files or the hub). Validation documents are
held out by their index in the whole stream (the rule preparation applies); the rest is divided between ranks
with ``split_dataset_by_node`` (whole shards when their number divides the world size, else every
``dp``-th document), tokenized on each rank and packed into ``seq_len`` windows, ``micro_batch_size`` per micro
batch. The reader's position (the data set's own ``state_dict``) and the tokens not yet packed are saved in
checkpoints, per rank, as plain ints and strings: a resume on the same world size continues exactly. Other
world sizes divide the stream differently, so such a resume is refused with a one-line error.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from ddptrain.config.schema import DataConfig
from ddptrain.data.batch import BatchShape
from ddptrain.data.corpus import FILE_LOADERS
from ddptrain.data.loader import TokenCount
from ddptrain.data.prepare import is_validation
from ddptrain.errors import ConfigError

log = logging.getLogger(__name__)


def stream_documents(cfg: DataConfig) -> Any:
    """The streaming data set of ``cfg`` (an ``IterableDataset`` of records), not yet split between ranks."""
    from datasets import load_dataset

    try:
        if cfg.source == "files":
            kind = FILE_LOADERS[Path(cfg.paths[0]).suffix.lower()]
            extra = {"sample_by": "document"} if kind == "text" else {}
            return load_dataset(kind, data_files=[str(Path(p).absolute()) for p in cfg.paths], split="train",
                                streaming=True, **extra)
        return load_dataset(cfg.name, cfg.subset, split=cfg.split, streaming=True)
    except Exception as exc:
        raise ConfigError(f"data.streaming=true: cannot stream data.source={cfg.source} ({type(exc).__name__}: "
                          f"{str(exc)[:160]})") from exc


def _texts(ds: Any, field: str, holdout: bool, val_fraction: float) -> Any:
    """Only the validation (``holdout``) or training documents of the whole stream, as ``{"text": ...}``."""
    return ds.filter(lambda _, i: is_validation(i, val_fraction) == holdout, with_indices=True).map(
        lambda ex: {"text": ex[field]})


def streamed_validation(cfg: DataConfig, tok: PreTrainedTokenizerBase, windows: int) -> list[dict[str, torch.Tensor]]:
    """At most ``windows`` validation windows, from the first validation documents of the stream (the same on
    every rank and world size)."""
    packer = Packer(tok, cfg.seq_len)
    out: list[dict[str, torch.Tensor]] = []
    for example in _texts(stream_documents(cfg), cfg.text_field, True, cfg.val_fraction):
        packer.add(example["text"])
        while (window := packer.take()) is not None:
            out.append({"input_ids": window})
            if len(out) == windows:
                return out
    if not out:
        raise ConfigError(f"data.streaming=true: the validation documents hold fewer than data.seq_len={cfg.seq_len} "
                          "tokens; raise data.val_fraction")
    return out


class Packer:
    """Documents in, ``seq_len`` windows out: each document's ids followed by EOS, concatenated, cut. ``pending``
    holds every token read but not yet handed out, so it and the reader's position are the whole state."""

    def __init__(self, tok: PreTrainedTokenizerBase, seq_len: int, pending: list[int] | None = None) -> None:
        self.backend, self.eos, self.seq_len = tok.backend_tokenizer, tok.eos_token_id, seq_len
        self.pending: list[int] = list(pending or [])

    def add(self, text: object) -> None:
        if isinstance(text, str) and text.strip():
            self.pending.extend(self.backend.encode(text, add_special_tokens=False).ids)
            self.pending.append(self.eos)

    def take(self) -> torch.Tensor | None:
        if len(self.pending) < self.seq_len:
            return None
        window, self.pending = self.pending[: self.seq_len], self.pending[self.seq_len :]
        return torch.tensor(window, dtype=torch.long)


class StreamedBatches:
    """This rank's endless stream of packed micro batches, read and tokenized as training goes; resumable on
    the same world size. Same interface as ``MicroBatches``."""

    def __init__(self, cfg: DataConfig, tok: PreTrainedTokenizerBase, shape: BatchShape, rank: int,
                 device: torch.device) -> None:
        from datasets.distributed import split_dataset_by_node

        self.cfg, self.tok, self.shape, self.rank, self.device = cfg, tok, shape, rank, device
        train = _texts(stream_documents(cfg), cfg.text_field, False, cfg.val_fraction)
        self.dataset = split_dataset_by_node(train, rank=rank, world_size=shape.dp)
        self.epoch = 0
        self.position = 0  # global windows of this epoch consumed by all ranks together
        self.packer = Packer(tok, cfg.seq_len)
        self.tokens = TokenCount()  # fixed windows: every position is a real token
        # real tokens every rank has trained on (each window is seq_len of them); None: resumed from a checkpoint
        # of an earlier version, which did not record it (the loop then counts steps x tokens per step)
        self.tokens_seen: int | None = 0
        self.reader: dict[str, Any] | None = None  # the data set's state after the last document read
        self._examples: Iterator[dict[str, Any]] | None = None

    def __iter__(self) -> StreamedBatches:
        return self

    def __next__(self) -> torch.Tensor:
        rows: list[torch.Tensor] = []
        while len(rows) < self.shape.micro_batch_size:
            window = self.packer.take()
            if window is not None:
                rows.append(window)
                continue
            if self._examples is None:
                self.dataset.set_epoch(self.epoch)
                if self.reader is not None:
                    self.dataset.load_state_dict(copy.deepcopy(self.reader))
                self._examples = iter(self.dataset)
            example = next(self._examples, None)
            if example is None:  # this rank's share is read through: the next epoch reads it again
                if self.reader is None:
                    raise ConfigError(f"data.streaming=true: rank {self.rank} has no training document to read")
                self.epoch, self.position, self.reader, self._examples = self.epoch + 1, 0, None, None
                continue
            self.packer.add(example["text"])
            self.reader = self.dataset.state_dict()
        self.position += self.shape.micro_batch_size * self.shape.dp
        if self.tokens_seen is not None:
            self.tokens_seen += self.shape.micro_batch_size * self.shape.dp * self.cfg.seq_len
        batch = torch.stack(rows)
        self.tokens.count({"input_ids": batch})
        return batch.to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` and ``position`` like ``MicroBatches``; ``stream``: every rank's reader position and unread
        tokens, as JSON text (gathered to every rank: a collective, so called on every rank)."""
        mine = {"reader": self.reader, "pending": self.packer.pending}
        states: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        return {"epoch": self.epoch, "position": self.position, "stream": json.dumps(states),
                "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stream = state.get("stream")
        if stream is None:
            raise ConfigError("data.streaming=true: the checkpoint has no reader positions (it was saved without "
                              "streaming); resume it with data.streaming=false")
        states = json.loads(stream)
        if len(states) != self.shape.dp:
            raise ConfigError(f"data.streaming=true: the checkpoint's reader positions are for {len(states)} ranks "
                              f"and this run has {self.shape.dp}; each rank reads its own part of the stream, so "
                              f"resume on {len(states)} ranks (or use prepared data, data.streaming=false)")
        mine = states[self.rank]
        self.epoch, self.position = state["epoch"], state["position"]
        self.tokens_seen = state.get("tokens_seen")
        self.reader, self._examples = mine["reader"], None
        self.packer = Packer(self.tok, self.cfg.seq_len, mine["pending"])
