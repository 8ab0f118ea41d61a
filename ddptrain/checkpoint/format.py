"""Every file of a checkpoint, its size and its checksum: recorded at commit, checked before anything is read.

A copy cut short, a full disk or a flipped bit then shows up as a sentence naming the file (missing, truncated:
N of M bytes, checksum mismatch) instead of an unpickler's traceback half way through loading. The checksum is
CRC-32 (zlib) over 1 MiB blocks: it guards against damage, not tampering (checkpoints cannot run code anyway,
see ``safe``), and at about 2 GB/s it is several times faster than SHA-256 here. zlib releases the GIL on large
blocks, so the background writer of an async save checksums while training goes on.
"""

from __future__ import annotations

import zlib
from pathlib import Path

BLOCK = 2**20
MANIFEST_KEY = "files"  # in the COMMITTED marker: {relative path: {"bytes": n, "crc32": hex}}


def checksum(path: Path) -> str:
    crc = 0
    with path.open("rb") as stream:
        while block := stream.read(BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def manifest(directory: Path, skip: frozenset[str] = frozenset()) -> dict[str, dict[str, int | str]]:
    """Size and checksum of every file under ``directory`` (relative POSIX paths), except the names in ``skip``."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in skip)
    return {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "crc32": checksum(p)} for p in files}


def damage(directory: Path, recorded: dict[str, dict[str, int | str]], sizes_only: bool = False) -> list[str]:
    """What is wrong with the files ``recorded`` lists: one entry per damaged file; empty when all are intact.

    ``sizes_only``: check presence and sizes (a stat per file) without reading the data.
    """
    problems = []
    for name, expected in recorded.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            kind = "truncated" if size < int(expected["bytes"]) else "longer than written"
            problems.append(f"{name}: {kind}: {size} of {expected['bytes']} bytes")
        elif not sizes_only and checksum(path) != expected["crc32"]:
            problems.append(f"{name}: checksum mismatch (its contents changed since the commit)")
    return problems


def total_bytes(recorded: dict[str, dict[str, int | str]]) -> int:
    return sum(int(entry["bytes"]) for entry in recorded.values())
