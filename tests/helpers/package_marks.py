"""A pytest plugin: every test is marked with the ``ddptrain`` packages its file uses, so the tests of a changed
file run with ``pytest -m <package>`` (``pytest -m "data and not slow"``: its fast tier).

A test file uses a package when it imports one of its modules anywhere (module level or inside a function), or a
helper in ``tests/helpers/`` that does; a test that runs the real command (``tests/helpers/cli.py`` and the
helpers built on it, or the ``cli_runs``/``torchrun_run`` fixtures) uses ``app``, and one that asks for the
``compose`` fixture uses ``config``. The marks follow the imports, so they stay true as tests change; the plan's
subpackages have marks of their own too (``plan_memory``, ``plan_whatif``, ``plan_analytic``). A run that selects by
none of them (``-m "not slow"``) is not marked: the marks are made when ``-m`` or ``-k`` names one.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
RUNS_THE_COMMAND = {"tests.helpers.cli"}  # and every helper that imports it
FIXTURE_PACKAGES = {"compose": "config", "cli_runs": "app", "torchrun_run": "app", "pretrained_base": "models"}


def imported_names(path: Path) -> set[str]:
    """Every module an import in ``path`` names, inside functions too (``from X import y`` as ``X`` and ``X.y``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def packages_named(names: set[str]) -> set[str]:
    """``ddptrain.data.loader`` -> ``data``; ``ddptrain.plan.memory.trace`` -> ``plan`` and ``plan_memory``."""
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != "ddptrain" or len(parts) < 2 or parts[1] in ("__main__", "configs"):
            continue
        found.add(parts[1])
        if parts[1] == "plan" and len(parts) > 2 and (REPO / "ddptrain" / "plan" / parts[2]).is_dir():
            found.add(f"plan_{parts[2]}")
    return found


@functools.cache
def helper_packages(module: str) -> frozenset[str]:
    """The packages a ``tests.helpers`` module uses (through the helpers it imports too)."""
    path = REPO / Path(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return frozenset()
    names = imported_names(path)
    found = packages_named(names)
    if module in RUNS_THE_COMMAND:
        found.add("app")
    for helper in {n for n in names if n.startswith("tests.helpers.") and n != module}:
        found |= helper_packages(helper)
    return frozenset(found)


@functools.cache
def file_packages(path: Path) -> frozenset[str]:
    names = imported_names(path)
    found = packages_named(names)
    for helper in {n for n in names if n.startswith("tests.helpers.")}:
        found |= helper_packages(helper)
    return frozenset(found)


def packages_of(item: pytest.Item) -> set[str]:
    found = set(file_packages(Path(item.path)))
    return found | {p for f, p in FIXTURE_PACKAGES.items() if f in getattr(item, "fixturenames", ())}


def selects_by_package(config: pytest.Config) -> bool:
    """Whether ``-m`` or ``-k`` names a package mark: only then are the marks needed. Reading every test file's
    imports costs 1.3 CPU s per collection, paid by every xdist worker before its first test."""
    words = set(re.findall(r"\w+", f"{config.option.markexpr or ''} {config.option.keyword or ''}"))
    return bool(words & set(all_packages()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not selects_by_package(config):
        return
    for item in items:
        for package in sorted(packages_of(item)):
            item.add_marker(package)


def all_packages() -> list[str]:
    """Every package (and top-level module, ``errors``) of ``ddptrain`` and subpackage of its plan, as mark names."""
    root = REPO / "ddptrain"
    top = sorted([p.name for p in root.iterdir() if (p / "__init__.py").is_file()] +
                 [p.stem for p in root.glob("*.py") if p.stem not in ("__init__", "__main__")])
    plan = sorted(f"plan_{p.name}" for p in (REPO / "ddptrain" / "plan").iterdir() if (p / "__init__.py").is_file())
    return top + plan


def pytest_configure(config: pytest.Config) -> None:
    for package in all_packages():
        config.addinivalue_line("markers", f"{package}: the test's file uses ddptrain's {package.replace('_', '.')} "
                                           f"(tests/helpers/package_marks.py)")
