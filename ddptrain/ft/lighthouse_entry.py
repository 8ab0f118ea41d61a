"""``python <this file> ARGS``: torchft's lighthouse (its ``torchft_lighthouse`` console script's function), started
without importing the ``torchft`` package.

The wheel's console script runs ``from torchft._torchft import lighthouse_main``, which first runs the package's
``__init__``: torch, the Manager and the process groups, 1.9 CPU s and 6-8 s of wall-clock on a busy 2-core machine,
before the Rust server (which needs none of it) listens; every group of a local run waits for it. Here the
extension module is found where the package lays it out and loaded alone (0.03 CPU s, 0.1 s); an install whose
extension is not a file beside the package's ``__init__`` gets the console script's own import.

Run as a file, not ``-c`` or ``-m``: the lighthouse (Rust) reads the process's own arguments after the first, which
must then be this file's path."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable

EXTENSION = "torchft._torchft"


def lighthouse_main() -> Callable[[], object]:
    """torchft's ``lighthouse_main``, from its extension module loaded on its own when it can be."""
    package = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    for folder in (package.submodule_search_locations or []) if package is not None else []:
        finder = importlib.machinery.FileFinder(folder, (importlib.machinery.ExtensionFileLoader,
                                                         importlib.machinery.EXTENSION_SUFFIXES))
        spec = finder.find_spec(EXTENSION)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.lighthouse_main
    from torchft._torchft import lighthouse_main as imported  # the console script's way: the whole package first

    return imported


if __name__ == "__main__":
    sys.exit(lighthouse_main()())
