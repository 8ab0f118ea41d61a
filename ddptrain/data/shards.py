"""Flat token shards: the file format, its writer, and ``seq_len`` windows read through memory maps.

A shard is a 64-byte header, the token ids (``uint16`` when the vocabulary fits, else ``uint32``): the documents
of a split in corpus order, each followed by EOS, as llm.c and nanoGPT store them; then a CRC-32 of every
``CHECK_BLOCK`` bytes of those ids. The header says how many tokens and documents follow and which documents of
the corpus stream they are, so a half-written shard (a file size that disagrees) or a foreign file (a wrong
magic) is refused by name when training starts, and an interrupted preparation knows where to continue. The
checksums catch damage that keeps the size (flipped bits, a block overwritten): each block is checked the first
time a process reads from it, so start-up reads no token data and a run checks only what it reads. Shards are
written under a name unique to the writer and renamed into place when complete: a shard that exists is whole.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddptrain.errors import ConfigError

MAGIC = b"DDPTOKS2"
# magic, itemsize, tokens, documents, first document, end document, eos, bytes per checksummed block
HEADER = struct.Struct("<8s7Q")
HEADER_BYTES = 64
assert HEADER.size == HEADER_BYTES
# Token bytes per CRC-32: the size of what one page fault of a memory map brings in around a window anyway
# (the kernel's fault-around, 64 KiB by default), so checking a block on first use adds hashing (about 15 us per
# block here), not reading; the table costs 4 bytes per block (0.006% of the shard).
CHECK_BLOCK = 1 << 16


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
    block_bytes: int  # token bytes per checksum

    @property
    def token_bytes(self) -> int:
        return self.tokens * self.itemsize

    @property
    def blocks(self) -> int:
        return -(-self.token_bytes // self.block_bytes)


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
    shard = ShardInfo(path, *HEADER.unpack(raw)[1:])
    if shard.itemsize not in (2, 4) or shard.block_bytes == 0 or shard.block_bytes % shard.itemsize:
        raise ConfigError(f"token shard {path}: corrupt header; delete the directory to prepare it again")
    expected = HEADER_BYTES + shard.token_bytes + 4 * shard.blocks
    if size != expected:
        raise ConfigError(f"token shard {path}: truncated or corrupt ({size} bytes, the header promises "
                          f"{expected}); delete the directory to prepare it again")
    return shard


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
        self._checksums: list[int] = []  # of the shard's finished blocks (at most shard_tokens' worth)
        self._crc = self._block_fill = 0  # of the block being written

    def add(self, tokens: np.ndarray, documents: int, first_document: int, end_document: int) -> None:
        """Append ``documents`` whole documents (already EOS-terminated) taken from the stream at
        ``[first_document, end_document)``."""
        if self._file is None:
            self._tmp = self.directory / f".{self.prefix}-{self.index:05d}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
            self._file = self._tmp.open("wb")
            self._file.write(bytes(HEADER_BYTES))
            self._tokens = self._docs = 0
            self._first = first_document
            self._checksums, self._crc, self._block_fill = [], 0, 0
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._checksum(memoryview(data))
        self._tokens += len(tokens)
        self._docs += documents
        self.next_document = end_document
        if self._tokens >= self.shard_tokens:
            self.finish()

    def _checksum(self, data: memoryview) -> None:
        """Fold ``data`` into the blocks' CRC-32s, in the same pass as writing it."""
        while data:
            part = data[: CHECK_BLOCK - self._block_fill]
            self._crc = zlib.crc32(part, self._crc)
            self._block_fill += len(part)
            data = data[len(part) :]
            if self._block_fill == CHECK_BLOCK:
                self._checksums.append(self._crc)
                self._crc = self._block_fill = 0

    def finish(self) -> None:
        """Write the checksums and the header, make the shard durable and rename it into place (a no-op with
        nothing open)."""
        if self._file is None or self._tmp is None:
            return
        if self._block_fill:
            self._checksums.append(self._crc)
        self._file.write(np.array(self._checksums, dtype="<u4").tobytes())
        self._file.seek(0)
        self._file.write(HEADER.pack(MAGIC, self.dtype.itemsize, self._tokens, self._docs, self._first,
                                     self.next_document, self.eos, CHECK_BLOCK))
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


def open_checksums(shard: ShardInfo) -> np.memmap:
    """The CRC-32 of each ``block_bytes`` of the shard's token ids, memory-mapped read-only."""
    return np.memmap(shard.path, dtype=np.dtype("<u4"), mode="r", offset=HEADER_BYTES + shard.token_bytes,
                     shape=(shard.blocks,))


def check_blocks(shard: ShardInfo, tokens: np.ndarray, checksums: np.ndarray, blocks: range) -> None:
    """Compare ``blocks`` of the shard's token ids (``tokens``, as ``open_tokens`` maps them) with the checksums
    written with them: damage is a one-line error naming the file and the bytes."""
    per_block = shard.block_bytes // shard.itemsize
    for block in blocks:
        data = tokens[block * per_block : (block + 1) * per_block]
        if zlib.crc32(data) != int(checksums[block]):
            first = HEADER_BYTES + block * shard.block_bytes
            raise ConfigError(f"token shard {shard.path}: corrupt (bytes {first}-{first + data.nbytes - 1} do not "
                              "match the checksum written when it was prepared); delete the directory to prepare "
                              "it again")


def check_shard(shard: ShardInfo) -> None:
    """Check every block of a shard against its checksums (reads the whole file)."""
    check_blocks(shard, open_tokens(shard), open_checksums(shard), range(shard.blocks))


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
    each process (DataLoader workers too), so pickling the data set copies paths, not tokens. Each checksummed
    block of a shard is checked the first time this process reads a window from it.
    """

    def __init__(self, shards: list[ShardInfo], seq_len: int) -> None:
        self.shards, self.seq_len = shards, seq_len
        counts = np.array([s.tokens // seq_len for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._open: dict[int, tuple[np.memmap, np.memmap, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        offset = (index - int(self.starts[shard])) * self.seq_len
        tokens, checksums, checked = self.opened(shard)
        info = self.shards[shard]
        first_block = offset * info.itemsize // info.block_bytes
        end_block = -(-(offset + self.seq_len) * info.itemsize // info.block_bytes)  # rounded up
        for block in range(first_block, end_block):
            if not checked[block]:
                check_blocks(info, tokens, checksums, range(block, block + 1))
                checked[block] = True
        window = tokens[offset : offset + self.seq_len]
        return {"input_ids": torch.from_numpy(window.astype(np.int64))}

    def opened(self, shard: int) -> tuple[np.memmap, np.memmap, np.ndarray]:
        """Shard ``shard``'s token ids and checksums, memory-mapped on first use, and which blocks this process has
        checked (one flag per 64 KiB of tokens)."""
        if shard not in self._open:
            info = self.shards[shard]
            self._open[shard] = (open_tokens(info), open_checksums(info), np.zeros(info.blocks, dtype=bool))
        return self._open[shard]

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_open": {}}
