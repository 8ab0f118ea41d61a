"""Reading a checkpoint never runs code from it: every file goes through a loader that builds only plain data.

Checkpoints travel between people and machines, and a pickle can run any code while it loads. So ``trainer.pt``
and ``rng/rank*.pt`` hold only tensors, numbers, strings, lists and dicts and are read with
``torch.load(weights_only=True)``; the RNG states of Python and NumPy are converted to those types. The one
remaining pickle, torch.distributed.checkpoint's ``state/.metadata``, is read by an unpickler that builds only
the classes of that metadata (``SafeReader``). A file that needs anything else is refused in one line naming
the file and the type.

Checkpoints of earlier ddptrain versions stored NumPy's RNG state as an array (a type the safe loader refuses):
``ddptrain-ckpt convert PATH --trust`` rewrites them once, for someone who trusts where they came from.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ddptrain.errors import ConfigError

# torch names the refused global ("Unsupported global: GLOBAL numpy...", "unsupported GLOBAL posix.system ...").
_UNSUPPORTED = re.compile(r"GLOBAL (?P<name>[\w.]+)|(?P<other>Unsupported operand \d+)")


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file that can only be read by running code that it names."""


def load_plain(path: Path) -> Any:
    """``torch.load`` of a file that holds plain data; refuses, in one line, a file that needs anything else."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED.search(str(exc))
        name = (found["name"] or found["other"]) if found else "a type the safe loader does not build"
        raise UnsafeCheckpoint(
            f"{path}: refused to load: it needs {name}, which could run code (only tensors, numbers, strings, lists "
            "and dicts are read); if it comes from an earlier ddptrain and you trust it, convert it once with "
            f"ddptrain-ckpt convert {path.parent.parent if path.parent.name == 'rng' else path.parent} --trust"
        ) from exc


# ---- torch.distributed.checkpoint's metadata --------------------------------------------------------------------

def _allowed(module: str, name: str) -> bool:
    """The globals a DCP ``.metadata`` pickle names: its own classes, torch dtypes and sizes, layouts."""
    if module == dcp_metadata.__name__:
        return isinstance(getattr(dcp_metadata, name, None), type)
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("torch.serialization", "_get_layout"),
                              ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("collections", "OrderedDict"), ("pathlib", "PosixPath")}  # the checkpoint id


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader, with a metadata unpickler that builds only metadata classes
    (torch's own uses ``pickle.load``, which runs whatever the file names). Tensor data is read by torch with
    ``weights_only=True`` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # torch asks for a rank's own metadata file when the global one is absent
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with path.open("rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpoint(f"{path}: refused to load: {exc} could run code (a checkpoint's metadata "
                                       "names only torch.distributed.checkpoint's classes)") from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path}: not torch.distributed.checkpoint metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---- RNG states as plain data ------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) generator states, in types ``weights_only`` loads."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def convert_trusted(checkpoint: Path) -> list[Path]:
    """Rewrite an earlier version's ``trainer.pt`` and RNG files in plain types; returns the files rewritten
    (files that already load safely are left as they are).

    Runs the files' pickles (``weights_only=False``): only for a checkpoint whose origin the user trusts.
    """
    rewritten = []
    for path in [checkpoint / "trainer.pt", *sorted((checkpoint / "rng").glob("rank*.pt"))]:
        if not path.is_file() or _loads_plainly(path):
            continue
        old = torch.load(path, weights_only=False)
        if path.name == "trainer.pt":
            torch.save({k: _plain(v) for k, v in dict(old).items()}, path)
        else:
            version, internal, gauss = old["python"]
            kind, keys, pos, has_gauss, cached = old["numpy"]
            new = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
                   "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                             "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                   "torch": old["torch"], **({"cuda": old["cuda"]} if "cuda" in old else {})}
            torch.save(new, path)
        rewritten.append(path)
    return rewritten


def _loads_plainly(path: Path) -> bool:
    try:
        load_plain(path)
    except UnsafeCheckpoint:
        return False
    return True


def _plain(value: Any) -> Any:
    """Containers and NumPy scalars as Python lists, dicts and numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
