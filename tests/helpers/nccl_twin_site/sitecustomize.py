"""Installs the NCCL-semantics twin (``tests/helpers/nccl_twin.py``) in every process that imports
``torch.distributed`` while ``TWIN_NCCL=1``: the hang tests put this folder on ``PYTHONPATH`` of the real command
(launcher and torchrun workers), so the product runs unchanged and never names the twin."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
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
            from tests.helpers.nccl_twin import install

            install()

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


if os.environ.get("TWIN_NCCL") == "1":
    sys.meta_path.insert(0, _AfterImport())
