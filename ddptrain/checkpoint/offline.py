"""Read a checkpoint on one CPU process, without torchrun: a summary, a ``save_pretrained`` export, a full check.

torch.distributed.checkpoint loads without a process group here; each tensor is read whole, whatever strategy
and world size wrote it in shards.
"""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ddptrain.checkpoint.format import (
    MANIFEST_KEY,
    MARKER,
    TrainState,
    find_checkpoint,
    find_damage,
    manifest,
    model_fingerprint,
    read_marker,
    read_trainer_state,
)
from ddptrain.checkpoint.safe import SafeReader, convert_trusted, load_plain
from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError

log = logging.getLogger(__name__)
CHUNK_BYTES = 256 * 2**20  # verify reads tensors in groups of about this size, so memory stays bounded


def open_checkpoint(path: Path, checksums: bool = False) -> tuple[Path, dict[str, Any], TrainState]:
    """The checkpoint ``path`` names (itself, or a run directory's latest), its marker metadata and trainer state.

    The files' sizes are checked against the marker's record first (a stat each), so a truncated or missing
    file is named instead of failing inside a reader; ``checksums``: their checksums too (every byte read once),
    for a caller that passes the tensors on.
    """
    found = find_checkpoint(path, "checkpoints", "PATH")
    read_marker(found, "PATH")
    if problems := find_damage(found, sizes_only=not checksums):
        raise ConfigError(f"PATH: {found} is damaged: {problems[0]}")
    meta, state = read_trainer_state(found, "PATH")
    for rng in sorted((found / "rng").glob("rank*.pt")):
        load_plain(rng)  # RNG files too hold plain data only: one that would run code is refused here
    return found, meta, state


def tensor_entries(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor in ``state/`` by its flat key (``model.<name>``, ``optim.state.<name>.<key>``), with its size."""
    try:
        metadata = SafeReader(str(checkpoint / "state")).read_metadata()
    except ConfigError:
        raise
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"PATH: {checkpoint} has no readable state/ ({type(exc).__name__})") from exc
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_tensors(checkpoint: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors under ``keys``, gathered from every rank's shards."""
    entries = tensor_entries(checkpoint)
    wanted = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        # DCP warns that it is "assuming the intent is to load in a single process" even when told so (no_dist)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        dcp.load(wanted, storage_reader=SafeReader(str(checkpoint / "state")), no_dist=True)
    return wanted


def build_model(checkpoint: Path, device: str = "cpu") -> PreTrainedModel:
    """The model the checkpoint was saved from, rebuilt from its ``hf/config.json`` (weights not loaded)."""
    config = AutoConfig.from_pretrained(str(checkpoint / "hf"))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def export(path: Path, out: Path, overwrite: bool = False) -> Path:
    """``save_pretrained`` of the checkpoint's model (and its tokenizer) into ``out``; returns the checkpoint used.

    ``out`` must be a new or empty directory (``overwrite``: a non-empty one is written over). Success is
    reported only after the export is read back with transformers and its weights equal the checkpoint's.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT={out}: is a file; export writes a directory (choose another path)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"OUT={out}: directory is not empty; choose another, or pass --overwrite to write over it")
    checkpoint, _, _ = open_checkpoint(path, checksums=True)  # a flipped bit must not become exported weights
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards", "Loading weights": the command prints its own line
    model = build_model(checkpoint)
    names = list(model.state_dict())
    tensors = read_tensors(checkpoint, [f"model.{k}" for k in names])
    model.load_state_dict({k: tensors[f"model.{k}"] for k in names})
    model.save_pretrained(str(out))
    if (checkpoint / "hf" / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(checkpoint / "hf")).save_pretrained(str(out))
    try:
        written = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"OUT={out}: the export cannot be read back with transformers ({type(exc).__name__})") \
            from exc
    differ = [k for k, v in model.state_dict().items() if k not in written or not torch.equal(written[k], v)]
    if differ:
        raise ConfigError(f"OUT={out}: read back, {len(differ)} tensors differ from the checkpoint (first {differ[0]})")
    return checkpoint


def info(path: Path, overrides: list[str] | None) -> list[str]:
    """Step, strategy, world size, parameter count, data position, and the differences of the checkpoint's config
    from its run's (``run_config``) with ``overrides`` on top (None: no diff)."""
    checkpoint, meta, state = open_checkpoint(path)
    now = run_config(checkpoint, overrides) if overrides is not None else None
    lines = [
        f"checkpoint   {checkpoint}",
        f"step         {meta['step']}",
        f"strategy     {meta['strategy']} on {meta['world_size']} ranks (global batch {state.global_batch_size})",
        f"parameters   {meta['parameters']:,}",
        f"data         epoch {state.epoch}, {state.samples_in_epoch} samples of the epoch's global order consumed",
    ]
    if now is not None:
        saved = _flat(OmegaConf.to_container(OmegaConf.load(checkpoint / "config.yaml")))
        current = _flat(OmegaConf.to_container(OmegaConf.structured(now), enum_to_str=True))
        diff = [f"  {k}: {saved.get(k, '(absent)')!r} -> {current.get(k, '(absent)')!r}"
                for k in sorted(saved.keys() | current.keys()) if saved.get(k) != current.get(k)]
        lines.append("config diff  (checkpoint -> run config" + (" + overrides)" if overrides else ")")
                     if diff else "config diff  none")
        lines.extend(diff)
    return lines


def run_config(checkpoint: Path, overrides: list[str]) -> Config:
    """The config of the checkpoint's run, typed: its run dir's ``config.yaml`` (the run's own composition, the
    latest launch's; else the checkpoint's own ``config.yaml``), with ``key=value`` overrides on top. Not the
    defaults: a diff against them would list every choice the run made (its experiment, model, data)."""
    own = checkpoint.parent.parent / "config.yaml"
    base = OmegaConf.load(own if own.is_file() else checkpoint / "config.yaml")
    dotted = []
    for override in overrides:
        key = override.split("=", 1)[0].removeprefix("+")
        if "=" not in override or "." not in key or key.startswith("~"):
            raise ConfigError(f"{override}: expected key=value for a key of the run's config (info diffs against "
                              "the run's own config.yaml: config groups cannot be chosen here)")
        dotted.append(override.removeprefix("+"))
    return build_config(base, OmegaConf.from_dotlist(dotted))


def verify(path: Path) -> tuple[Path, list[str], int]:
    """Check every file against the sizes and checksums recorded at commit, then every tensor: present for every
    model entry, shaped like the model's parameter, finite.

    Returns the checkpoint, the problems found (empty when it is sound) and how many tensors were read. Damaged
    files are reported without reading tensors (which would fail on them).
    """
    checkpoint = find_checkpoint(path, "checkpoints", "PATH")
    meta = read_marker(checkpoint, "PATH")
    if not meta.get(MANIFEST_KEY):
        log.warning("%s: %s records no file sizes or checksums (an earlier ddptrain wrote it): only its tensors "
                    "are checked", checkpoint, MARKER)
    elif problems := find_damage(checkpoint):
        return checkpoint, problems, 0
    checkpoint, meta, state = open_checkpoint(checkpoint)
    model = build_model(checkpoint, device="meta")
    problems = []
    if model_fingerprint(model) != meta["fingerprint"]:
        problems.append("hf/config.json builds a model whose parameter names or shapes differ from the marker's")
    entries = tensor_entries(checkpoint)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in shapes.items():
        entry = entries.get(f"model.{name}")
        if entry is None:
            problems.append(f"model.{name}: missing")
        elif tuple(entry.size) != shape:
            problems.append(f"model.{name}: shape {tuple(entry.size)}, the model has {shape}")
    for key, entry in entries.items():
        param = _owner(key, shapes)
        if key.startswith("optim.state.") and len(entry.size) and (param is None or tuple(entry.size) != shapes[param]):
            problems.append(f"{key}: shape {tuple(entry.size)} does not match a parameter of the model")
    for group in _chunks(entries):
        for key, tensor in read_tensors(checkpoint, group).items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problems.append(f"{key}: {int((~torch.isfinite(tensor)).sum())} non-finite values")
    for rank in range(state.world_size):
        if not (checkpoint / "rng" / f"rank{rank}.pt").is_file():
            problems.append(f"rng/rank{rank}.pt: missing")
    return checkpoint, problems, len(entries)


def _owner(key: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The parameter an ``optim.state.<name>.<entry>`` key belongs to."""
    name = key.removeprefix("optim.state.").rpartition(".")[0]
    return name if name in shapes else None


def _chunks(entries: dict[str, TensorStorageMetadata]) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for key, entry in entries.items():
        nbytes = entry.size.numel() * entry.properties.dtype.itemsize
        if groups[-1] and size + nbytes > CHUNK_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


def convert(path: Path) -> tuple[Path, list[Path]]:
    """Rewrite a trusted checkpoint of an earlier ddptrain in plain types (see ``safe.convert_trusted``); the
    marker's record of sizes and checksums, if any, is renewed for the rewritten files."""
    checkpoint = find_checkpoint(path, "checkpoints", "PATH")
    meta = read_marker(checkpoint, "PATH")
    rewritten = convert_trusted(checkpoint)
    if meta.get(MANIFEST_KEY):
        meta[MANIFEST_KEY] = manifest(checkpoint, skip=frozenset({MARKER}))
        (checkpoint / MARKER).write_text(json.dumps(meta) + "\n")
    return checkpoint, rewritten
