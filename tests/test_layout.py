"""The package's shape: packages in one order with no upward import and no module cycle (lazy imports included), no
private Hydra API, no test importing another."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def _modules(root: str) -> dict[str, Path]:
    found = {}
    for path in (REPO / root).rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path) -> list[str]:
    """Every module named by an import anywhere in the file (functions' lazy imports too), with ``from X import y``
    as both ``X`` and ``X.y``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _with_packages(name: str) -> list[str]:
    """``a.b.c`` and the packages its import runs first: ``a.b``, ``a``."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules its imports run: importing ``a.b.c`` runs the packages ``a`` and ``a.b`` too (except
    the module's own packages, which Python has started before the module)."""
    modules = _modules("ddptrain")
    return {m: {p for n in _imports(path) for p in _with_packages(n) if p in modules and p not in _with_packages(m)}
            for m, path in modules.items()}


# The packages bottom to top: each may import those before it, never one after it (imports inside functions
# included: a lazy import is still a dependency, only a later one). A package's ``__main__`` is an entry point
# like ``app`` (nothing imports it), so it may import anything.
LAYERS = (
    "errors",      # one-line errors every layer raises
    "diagnose",    # where each rank is, evidence of hangs: stdlib only, so every layer can report
    "config",      # the schema and its composition: knows no package that reads it
    "comm",        # ring collectives and their byte accounting
    "kernels",     # fused kernels and their torch references
    "runtime",     # process group, device, seeds, run dir
    "data",        # corpus -> tokens -> batches
    "models",      # presets, pretrained loading, LoRA
    "optim",       # optimizers and schedules
    "telemetry",   # timers, metrics, sinks
    "engines",     # from-scratch DDPs on one reducer core
    "parallel",    # wrap_model: DDP, ZeRO, FSDP2
    "checkpoint",  # the checkpoint format, saving and the offline library
    "testing",     # fault injection, as step hooks
    "plan",        # planners and predictors over models, data and optimizers
    "train",       # the loop
    "app",         # the commands: ddptrain, ddptrain-ckpt
)


def _layer(module: str) -> int:
    """Where ``module`` sits in ``LAYERS``; entry points (``__main__``) and the empty top package sit above all."""
    parts = module.split(".")
    if parts[-1] == "__main__" or len(parts) == 1:
        return len(LAYERS)
    return LAYERS.index(parts[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a later layer than the importer's own, as ``importer -> imported``."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if len(d.split(".")) > 1 and _layer(d) > _layer(m))


# Within ``plan``, bottom to top: the shared costs and a past run's measurements, then one package per question
# (the analytic plan; the traced memory plan and the what-if predictor, which may use it), then the dry run that
# combines them.
PLAN_LAYERS = (
    ("costs", "measured"),  # bytes per parameter, bytes sent, links; what plan.from_run's run measured
    ("analytic",),          # model state, batch and communication by arithmetic
    ("memory", "whatif"),   # the peak of a traced step; a measured step carried to other layouts
    ("dry_run",),           # what launch.dry_run=true prints
)


def _plan_layer(module: str) -> int | None:
    """Where a ``ddptrain.plan`` module sits in ``PLAN_LAYERS``; None for the package itself and other packages."""
    parts = module.split(".")
    if parts[:2] != ["ddptrain", "plan"] or len(parts) == 2:
        return None
    return next(i for i, names in enumerate(PLAN_LAYERS) if parts[2] in names)


def upward_plan_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import, inside ``plan``, of a module in a later plan layer than the importer's own."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if (mine := _plan_layer(m)) is not None and (theirs := _plan_layer(d)) is not None
                  and theirs > mine)


def test_every_package_has_a_place_in_the_layers() -> None:
    packages = {m.split(".")[1] for m in _modules("ddptrain") if "." in m and not m.endswith("__main__")}
    assert sorted(packages - set(LAYERS)) == []


def test_no_package_imports_one_above_it_even_inside_a_function() -> None:
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_a_lazy_upward_import(tmp_path: Path) -> None:
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def later():\n    from ddptrain.models.lora import validate_finetune_config\n")
    graph = import_graph()
    graph["ddptrain.config.schema"] |= {d for n in _imports(lazy) for d in _with_packages(n) if d in graph}
    assert "ddptrain.config.schema -> ddptrain.models.lora" in upward_imports(graph)


def test_every_plan_module_has_a_place_in_the_plan_layers() -> None:
    named = {n for names in PLAN_LAYERS for n in names}
    assert sorted({m.split(".")[2] for m in _modules("ddptrain") if m.startswith("ddptrain.plan.")} - named) == []


def test_no_plan_module_imports_one_above_it_within_plan() -> None:
    assert upward_plan_imports(import_graph()) == []


def test_the_plan_layer_check_finds_the_analytic_plan_importing_the_predictor() -> None:
    graph = import_graph()
    graph["ddptrain.plan.analytic.planner"].add("ddptrain.plan.whatif.calibration")
    assert "ddptrain.plan.analytic.planner -> ddptrain.plan.whatif.calibration" in upward_plan_imports(graph)


def test_the_package_has_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = import_graph()
    graph["ddptrain.config.schema"].add("ddptrain.app.cli")  # cli imports compose, which imports the schema
    assert any("ddptrain.app.cli" in c and "ddptrain.config.schema" in c for c in _cycles(graph))


def test_nothing_uses_hydras_private_modules() -> None:
    users = {m for m, p in _modules("ddptrain").items() if any(n.startswith("hydra._internal") for n in _imports(p))}
    assert users == set()


def test_no_test_module_imports_another() -> None:
    tests = {m for m in _modules("tests") if m.rpartition(".")[2].startswith("test_")}
    importing = {m: sorted(n for n in _imports(p) if n in tests)
                 for m, p in _modules("tests").items() if m in tests}
    assert {m: n for m, n in importing.items() if n} == {}


def _calls_cuda_is_available(path: Path) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "is_available"
               and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "cuda"
               for node in ast.walk(ast.parse(path.read_text())))


def test_no_test_asks_for_cuda_itself_the_gpu_mark_does() -> None:
    tests = _modules("tests")
    assert sorted(m for m, p in tests.items() if _calls_cuda_is_available(p)) == ["tests.conftest"]


GPU_AND_CPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_on_a_gpu():
    pass

def test_anywhere():
    pass
"""


def test_a_gpu_marked_test_is_skipped_without_cuda_and_runs_with_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(GPU_AND_CPU_TESTS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    without = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    without.assert_outcomes(passed=1, skipped=1)
    without.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: needs a CUDA device"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


LAUNCHER_IMPORTS = """
import sys
from ddptrain.app.preflight import validate_config
from ddptrain.config.compose import compose_config, typed_config
run = typed_config(compose_config([]))
validate_config(run.typed, run.typed.launch.nproc_per_node)
print(sorted(m for m in ("datasets", "transformers", "torch.distributed.fsdp", "torch._dynamo") if m in sys.modules))
"""


def test_the_launcher_checks_a_config_without_importing_the_training_stack() -> None:
    """The launcher composes and checks before it starts any worker, and every worker imports the training stack
    itself: what the launcher imports beyond that check is seconds of start-up on every run's critical path."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", LAUNCHER_IMPORTS], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
