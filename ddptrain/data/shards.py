"""Flat token shards: the file format, its writer, and ``seq_len`` windows read through memory maps.

A shard is a 64-byte header followed by token ids (``uint16`` when the vocabulary fits, else ``uint32``): the
documents of a split in corpus order, each followed by EOS, as llm.c and nanoGPT store them. The header says
how many tokens and documents follow and which documents of the corpus stream they are, so a half-written
shard (a file size that disagrees) or a foreign file (a wrong magic) is refused by name, and an interrupted
preparation knows where to continue. Shards are written under a name unique to the writer and renamed into
place when complete: a shard that exists is whole.
"""

from __future__ import annotations

import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddptrain.errors import ConfigError

MAGIC = b"DDPTOKS1"
HEADER = struct.Struct("<8s6Q8x")  # magic, itemsize, tokens, documents, first document, end document, eos
HEADER_BYTES = 64
assert HEADER.size == HEADER_BYTES


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocabularies up to 65536), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    itemsize: int
    tokens: int
    documents: int
    first_document: int  # index, in the corpus stream, of the shard's first document
    end_document: int  # index after its last document: where the next shard of this split continues
    eos: int


def read_header(path: Path) -> ShardInfo:
    """The shard's header, checked against the file's size: a truncated or foreign file is a one-line error."""
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"token shard {path}: cannot read it ({exc.strerror}); delete the directory to "
                          "prepare it again") from exc
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise ConfigError(f"token shard {path}: not a ddptrain token shard (bad header); delete the directory to "
                          "prepare it again")
    _, itemsize, tokens, docs, first, end, eos = HEADER.unpack(raw)
    expected = HEADER_BYTES + tokens * itemsize
    if itemsize not in (2, 4) or size != expected:
        raise ConfigError(f"token shard {path}: truncated or corrupt ({size} bytes, the header promises "
                          f"{expected}); delete the directory to prepare it again")
    return ShardInfo(path, itemsize, tokens, docs, first, end, eos)


class ShardWriter:
    """Appends documents' tokens to ``<prefix>-NNNNN.bin`` files, starting a new shard after a document once
    ``shard_tokens`` are reached. Memory holds one batch of tokens at a time, never a shard."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, eos: int, shard_tokens: int,
                 next_index: int = 0, next_document: int = 0) -> None:
        self.directory, self.prefix, self.dtype, self.eos = directory, prefix, dtype, eos
        self.shard_tokens = shard_tokens
        self.index = next_index  # of the shard being written
        self.next_document = next_document  # the stream index where this writer's next document must be
        self._file = None
        self._tmp: Path | None = None
        self._tokens = self._docs = 0
        self._first = next_document

    def add(self, tokens: np.ndarray, documents: int, first_document: int, end_document: int) -> None:
        """Append ``documents`` whole documents (already EOS-terminated) taken from the stream at
        ``[first_document, end_document)``."""
        if self._file is None:
            self._tmp = self.directory / f".{self.prefix}-{self.index:05d}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
            self._file = self._tmp.open("wb")
            self._file.write(bytes(HEADER_BYTES))
            self._tokens = self._docs = 0
            self._first = first_document
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._tokens += len(tokens)
        self._docs += documents
        self.next_document = end_document
        if self._tokens >= self.shard_tokens:
            self.finish()

    def finish(self) -> None:
        """Write the header, make the shard durable and rename it into place (a no-op with nothing open)."""
        if self._file is None or self._tmp is None:
            return
        self._file.seek(0)
        self._file.write(HEADER.pack(MAGIC, self.dtype.itemsize, self._tokens, self._docs, self._first,
                                     self.next_document, self.eos))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._tmp.replace(shard_path(self.directory, self.prefix, self.index))
        self._file, self._tmp = None, None
        self.index += 1

    def abandon(self) -> None:
        if self._file is not None and self._tmp is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._file, self._tmp = None, None


def shard_path(directory: Path, prefix: str, index: int) -> Path:
    return directory / f"{prefix}-{index:05d}.bin"


def open_tokens(shard: ShardInfo) -> np.memmap:
    """The shard's token ids, memory-mapped read-only (nothing is read until used)."""
    return np.memmap(shard.path, dtype=np.dtype(f"<u{shard.itemsize}"), mode="r", offset=HEADER_BYTES,
                     shape=(shard.tokens,))


def finished_shards(directory: Path, prefix: str) -> list[ShardInfo]:
    """The complete shards of a split, in order (each header checked)."""
    out = []
    while (path := shard_path(directory, prefix, len(out))).is_file():
        out.append(read_header(path))
    return out


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping ``seq_len`` windows of a split's shards, read through memory maps.

    A window never straddles two shards (each shard's tail shorter than ``seq_len`` is not used). Item ``i`` is
    ``{"input_ids": LongTensor[seq_len]}``, like a row of a packed data set. The memory maps open lazily in
    each process (DataLoader workers too), so pickling the data set copies paths, not tokens.
    """

    def __init__(self, shards: list[ShardInfo], seq_len: int) -> None:
        self.shards, self.seq_len = shards, seq_len
        counts = np.array([s.tokens // seq_len for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        offset = (index - int(self.starts[shard])) * self.seq_len
        window = self.maps()[shard][offset : offset + self.seq_len]
        return {"input_ids": torch.from_numpy(window.astype(np.int64))}

    def maps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [open_tokens(s) for s in self.shards]
        return self._maps

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_maps": None}
