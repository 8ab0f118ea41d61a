"""What the hang tests change in every process of the real command (launcher and torchrun workers), through this
folder on ``PYTHONPATH``, so that the product runs unchanged and never names them:

- ``TWIN_NCCL=1``: installs the NCCL-semantics twin (``tests/helpers/nccl_twin.py``) once ``torch.distributed``
  is imported;
- ``TWIN_NODES=N``: each worker of one launcher takes itself for one of N nodes (``LOCAL_WORLD_SIZE``,
  ``LOCAL_RANK`` and ``GROUP_RANK`` as torchrun would set them on N machines), so that HSDP
  (``parallel.shard_group=node``) builds its 2-D mesh under ddptrain's own launcher, whose last line is the
  verdict.

The twin is loaded from its file beside this folder: the checkout's root stays off the command's path (the command
must find ddptrain as it is installed, tests/helpers/cli.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


class _AfterImport(importlib.abc.MetaPathFinder):
    """Installs the twin right after ``torch.distributed`` has been imported (not before: no import of torch at
    interpreter start-up, which the launcher's import-time checks would see)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module: ModuleType) -> None:
            exec_module(module)
            _load_twin().install()

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


def _as_nodes(nodes: int) -> None:
    """Renumber this worker as torchrun numbers ranks on ``nodes`` machines (node by node)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = world // nodes
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node), GROUP_RANK=str(rank // per_node))


def _load_twin() -> ModuleType:
    """``tests/helpers/nccl_twin.py`` as the module ``nccl_twin``, from its file (no package on the path)."""
    spec = importlib.util.spec_from_file_location("nccl_twin", Path(__file__).parents[1] / "nccl_twin.py")
    assert spec is not None and spec.loader is not None
    twin = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = twin  # before it runs: its dataclasses look their module up there
    spec.loader.exec_module(twin)
    return twin


if os.environ.get("TWIN_NCCL") == "1":
    sys.meta_path.insert(0, _AfterImport())
if os.environ.get("TWIN_NODES") and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
    _as_nodes(int(os.environ["TWIN_NODES"]))
