"""The checkpoint format, what every reader and writer of a checkpoint shares: the ``COMMITTED`` marker and its
format number, the trainer state (``trainer.pt``), the model fingerprint, finding a run's checkpoints, and the
damage checks.

Every file of a checkpoint, its size and its checksum: recorded at commit, checked before anything is read.

A copy cut short, a full disk or a flipped bit then shows up as a sentence naming the file (missing, truncated:
N of M bytes, checksum mismatch) instead of an unpickler's traceback half way through loading. The checksum is
CRC-32 (zlib) over 1 MiB blocks: it guards against damage, not tampering (checkpoints cannot run code anyway,
see ``safe``), and at about 2 GB/s it is several times faster than SHA-256 here. zlib releases the GIL on large
blocks, so the background writer of an async save checksums while training goes on.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported by the one function that reads a pickle (``read_trainer_state``): finding checkpoints and
# checking their files does without it (the launcher's checks before any worker starts)

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


MARKER = "COMMITTED"
FORMAT = 2  # 2: one name-keyed DCP directory ``state/`` whatever the strategy


@dataclass
class TrainState:
    """``trainer.pt``: everything besides tensors that a resumed run needs to continue exactly.

    Its fields are the parts' own state dicts laid out as format 2 has them on disk; ``from_parts`` and
    ``parts`` are the one place that maps between the two.
    """

    step: int
    scheduler: dict[str, Any]
    epoch: int
    samples_in_epoch: int  # global samples of this epoch already consumed (all ranks): the data position
    world_size: int
    global_batch_size: int
    zero_stage: int
    grad_scaler: dict[str, Any] | None = None  # train.precision=fp16: the loss scale and its growth tracker
    stream: str | None = None  # data.streaming=true: every rank's reader position, as JSON text
    tokens_seen: int | None = None  # real tokens trained on by all ranks up to this step; None: an earlier version
    # ft.sync=diloco|streaming_diloco: the outer sync's state (each fragment's window-start weights and outer
    # momentum, the position in the window; ft/diloco.py), the same on every rank of a group; None without DiLoCo
    outer_sync: dict[str, Any] | None = None

    @classmethod
    def from_parts(cls, step: int, parts: dict[str, dict[str, Any]]) -> TrainState:
        """The record of ``step`` from the state dicts of the parts ``scheduler``, ``data`` (epoch, position,
        tokens_seen and, streaming, stream), ``run`` (world_size, global_batch_size, zero_stage), in fp16
        ``grad_scaler`` and under DiLoCo ``outer_sync``."""
        data, run = parts["data"], parts["run"]
        return cls(step, parts["scheduler"], data["epoch"], data["position"], run["world_size"],
                   run["global_batch_size"], run["zero_stage"], grad_scaler=parts.get("grad_scaler"),
                   stream=data.get("stream"), tokens_seen=data.get("tokens_seen"), outer_sync=parts.get("outer_sync"))

    def record(self) -> dict[str, Any]:
        """``trainer.pt``'s content: every field, except ``outer_sync`` when there is none (a run without DiLoCo
        writes the layout format 2 has always had, which earlier versions read)."""
        fields = dict(vars(self))
        if fields["outer_sync"] is None:
            del fields["outer_sync"]
        return fields

    def parts(self) -> dict[str, dict[str, Any]]:
        """Each part's state dict, as ``from_parts`` took it (``grad_scaler`` empty when not trained in fp16)."""
        return {"scheduler": self.scheduler,
                "data": {"epoch": self.epoch, "position": self.samples_in_epoch, "stream": self.stream,
                         "tokens_seen": self.tokens_seen},
                "run": {"world_size": self.world_size, "global_batch_size": self.global_batch_size,
                        "zero_stage": self.zero_stage},
                "grad_scaler": self.grad_scaler or {}, "outer_sync": self.outer_sync or {}}


def model_fingerprint(model: torch.nn.Module) -> str:
    """Names and (global) shapes of the model's state: equal fingerprints mean the weights fit, whatever the
    strategy (FSDP2's DTensors report their full shape)."""
    items = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def committed(root: Path) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first."""
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def find_checkpoint(path: Path, subdir: str, key: str) -> Path:
    """A checkpoint directory, or the latest committed one of a run directory (``<path>/<subdir>``)."""
    if (path / MARKER).is_file():
        return path
    for root in (path / subdir, path):
        if found := committed(root):
            return found[-1]
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such checkpoint or run directory")
    raise ConfigError(f"{key}={path}: no committed checkpoint there (expected step_*/{MARKER})")


def read_marker(path: Path, key: str) -> dict[str, Any]:
    """The ``COMMITTED`` marker's metadata (JSON), of a format this ddptrain reads; a one-line error otherwise."""
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {path}/{MARKER} is not readable ({type(exc).__name__})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format", 1) if isinstance(meta, dict) else "unknown"
        raise ConfigError(f"{key}: {path} has checkpoint format {found}; this ddptrain reads "
                          f"format {FORMAT} (name-keyed state/)")
    return meta


def read_trainer_state(path: Path, key: str) -> tuple[dict[str, Any], TrainState]:
    """The marker's metadata and the trainer state; a one-line error when either cannot be read (or would run
    code: ``trainer.pt`` holds plain data only)."""
    from ddptrain.checkpoint.safe import load_plain

    meta = read_marker(path, key)
    try:
        state = TrainState(**load_plain(path / "trainer.pt"))
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError, RuntimeError, EOFError) as exc:
        raise ConfigError(f"{key}: {path} is not a readable checkpoint ({type(exc).__name__})") from exc
    return meta, state


def find_damage(path: Path, sizes_only: bool = False) -> list[str]:
    """The damaged files of a committed checkpoint, checked against the sizes and checksums its marker records
    (empty when intact, or when an earlier version wrote no record)."""
    try:
        recorded = json.loads((path / MARKER).read_text()).get(MANIFEST_KEY)
    except (OSError, ValueError, AttributeError):
        return [f"{MARKER}: not readable"]
    return damage(path, recorded, sizes_only) if recorded else []


def describe_damage(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else "")


def newest_intact(candidates: list[Path]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """Of ``candidates`` (oldest first), the newest whose files match its marker's record: (its path, the damaged
    newer ones skipped with their problem, the problem when the only candidate asked for is damaged)."""
    skipped = []
    for path in reversed(candidates):
        problems = find_damage(path)
        if not problems:
            return str(path), skipped, None
        skipped.append((str(path), describe_damage(problems)))
    if len(candidates) == 1 and skipped:
        (path, problem), = skipped
        return None, [], f"{path} is damaged: {problem}; check it with ddptrain-ckpt verify {path}"
    if skipped:
        return None, [], (f"every checkpoint in {Path(skipped[0][0]).parent} is damaged (newest: {skipped[0][1]}); "
                          "check them with ddptrain-ckpt verify")
    return None, [], None


def overwrite_refusal(root: Path, latest: Path) -> str:
    """The line for a fresh run (no ``train.resume``) into a run directory whose checkpoints another run made."""
    return (f"hydra.run.dir={root.parent}: holds committed checkpoints of another run (latest {latest.name}); "
            "continue it with train.resume=auto, or start in a new hydra.run.dir (checkpoint.overwrite=true "
            "replaces them)")


def other_model(path: Path) -> str:
    """The line for a checkpoint whose model state does not fit this run's model."""
    return (f"train.resume: {path} was saved for a different model (parameter names or shapes differ); use the "
            "same model.* settings or a new run directory")
