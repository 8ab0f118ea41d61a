"""The package's shape: packages in one order with no upward import and no module cycle (lazy imports included), no
private Hydra API, no test importing another."""

from __future__ import annotations

import ast
import functools
import os
import re
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


@functools.cache
def _parsed(source: str) -> ast.Module:
    """A source's syntax tree, parsed once for every check here that reads it (the checks only read the trees)."""
    return ast.parse(source)


def _imports(path: Path) -> list[str]:
    """Every module named by an import anywhere in the file (functions' lazy imports too), with ``from X import y``
    as both ``X`` and ``X.y``."""
    names = []
    for node in ast.walk(_parsed(path.read_text())):
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
# like ``app`` (nothing imports it), so it may import anything. The step's pieces (``step``) sit below ``plan``,
# whose memory trace runs them on fake tensors, one definition of a training step; the trainer (``train``), which
# plans its own run, above it.
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
    "step",        # the step's pieces: micro batches' forward/backward, weighting, loss guard, clip, update
    "plan",        # planners and predictors over models, data and optimizers
    "ft",          # torchft replica groups: the outer sync (DiLoCo) the trainer steps
    "train",       # the trainer and its loop
    "app",         # the commands: ddptrain, ddptrain-ckpt
)


def _unit(module: str) -> str:
    """The entry of ``LAYERS`` a ``ddptrain.<package>...`` module belongs to: its package."""
    return module.split(".")[1]


def _layer(module: str) -> int:
    """Where ``module`` sits in ``LAYERS``; entry points (``__main__``) and the empty top package sit above all."""
    parts = module.split(".")
    if parts[-1] == "__main__" or len(parts) == 1:
        return len(LAYERS)
    return LAYERS.index(_unit(module))


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


def test_the_layer_check_finds_a_step_piece_importing_the_trainer_or_the_planner() -> None:
    graph = import_graph()
    graph["ddptrain.step.weighting"].add("ddptrain.train.trainer")
    graph["ddptrain.step"].add("ddptrain.plan.memory.trace")
    assert {"ddptrain.step.weighting -> ddptrain.train.trainer",
            "ddptrain.step -> ddptrain.plan.memory.trace"} <= set(upward_imports(graph))


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
               for node in ast.walk(_parsed(path.read_text())))


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


# The house rules (issue 42): one training step, under ``train/``; typed values between packages; one meaning per
# name. Each check below names what it found, so a failure says where.

PACKAGE = REPO / "ddptrain"


def _package_files(*packages: str) -> dict[str, ast.Module]:
    """``ddptrain/<package>/...`` (every package when none is named) -> its parsed module."""
    roots = [PACKAGE / p for p in packages] if packages else [PACKAGE]
    return {path.relative_to(REPO).as_posix(): _parsed(path.read_text())
            for root in roots for path in sorted(root.rglob("*.py"))}


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` for a name or attribute chain; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def backward_calls(files: dict[str, ast.Module]) -> list[str]:
    """Every call of autograd's backward: ``x.backward(...)`` or ``torch.autograd.backward(...)``, as ``file:line``."""
    return sorted(f"{path}:{node.lineno}" for path, tree in files.items() for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "backward")


def test_autograds_backward_is_called_only_in_the_step_package() -> None:
    """One definition of a training step: ``ddptrain/step/``, which the trainer and the memory planner both run."""
    outside = {p: t for p, t in _package_files().items() if not p.startswith("ddptrain/step/")}
    assert backward_calls(outside) == []
    assert backward_calls(_package_files("step")) != []  # the check looks where the step is


def test_the_backward_check_finds_a_backward_outside_the_step() -> None:
    found = backward_calls({"ddptrain/plan/x.py": ast.parse("def f(loss):\n    (loss * 2).backward()\n"),
                            "ddptrain/plan/y.py": ast.parse("import torch\ntorch.autograd.backward([x])\n")})
    assert found == ["ddptrain/plan/x.py:2", "ddptrain/plan/y.py:2"]


def test_nothing_in_the_package_imports_unittest() -> None:
    """No ``unittest.mock`` in production code: what a step needs changed is a parameter or hook it takes."""
    users = sorted(p for p, tree in _package_files().items() for node in ast.walk(tree)
                   if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "unittest" for a in node.names))
                   or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "unittest"))
    assert users == []


def optimizer_unwraps(files: dict[str, ast.Module]) -> list[str]:
    """Every place that reaches through ZeRO-1's ``ZeroRedundancyOptimizer`` to its local optimizer: its ``optim``
    attribute, through ``getattr`` or read off something named ``*optimizer*``."""
    found = []
    for path, tree in files.items():
        for node in ast.walk(tree):
            by_getattr = (isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) >= 2
                          and isinstance(node.args[1], ast.Constant) and node.args[1].value == "optim")
            by_attribute = (isinstance(node, ast.Attribute) and node.attr == "optim"
                            and "optimizer" in _dotted(node.value).lower())  # not the config's optim section
            if by_getattr or by_attribute:
                found.append(f"{path}:{node.lineno}")
    return sorted(found)


def test_zero1s_optimizer_is_unwrapped_in_one_place() -> None:
    """``optim.local_optimizer`` alone reaches through ZeRO-1's wrapper; everything else asks it."""
    found = optimizer_unwraps(_package_files())
    assert len(found) == 1 and found[0].startswith("ddptrain/optim/__init__.py:"), found


# Packages whose functions are read most: each takes at most MAX_PARAMETERS. ``self`` and ``cls`` do not count (the
# caller passes neither); ``*args`` and ``**kwargs`` count one each.
FEW_PARAMETER_PACKAGES = ("train", "plan", "telemetry", "data", "app", "checkpoint")
MAX_PARAMETERS = 7


def parameter_counts(files: dict[str, ast.Module]) -> dict[str, int]:
    """``file:line name`` -> the parameters of every function and method above ``MAX_PARAMETERS``."""
    found = {}
    for path, tree in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
                if count > MAX_PARAMETERS:
                    found[f"{path}:{node.lineno} {node.name}"] = count
    return found


def test_no_function_in_the_most_read_packages_takes_more_than_seven_parameters() -> None:
    assert parameter_counts(_package_files(*FEW_PARAMETER_PACKAGES)) == {}


def test_the_parameter_check_counts_arguments_not_self() -> None:
    source = ("class A:\n    def m(self, a, b, c, d, e, f, g):\n        pass\n\n"
              "def f(a, b, c, d, e, f, *g, h=1):\n    pass\n")
    assert parameter_counts({"x.py": ast.parse(source)}) == {"x.py:5 f": 8}


def summary_key_reads(files: dict[str, ast.Module]) -> list[str]:
    """Reads of a run summary by string key: ``summary["world_size"]``, ``summary.get("time_step_s")``,
    ``summary["predicted"].update(...)``, on anything named ``*summary*``."""
    found = []
    for path, tree in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str):
                base = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                base = node.func.value
            else:
                continue
            if "summary" in _dotted(base).lower():
                found.append(f"{path}:{node.lineno}")
    return sorted(found)


def test_plan_and_train_read_the_run_summarys_fields_not_string_keys() -> None:
    assert summary_key_reads(_package_files("plan", "train")) == []


def test_the_summary_key_check_finds_a_keyed_read() -> None:
    source = ("def f(summary, run):\n    summary['predicted'].update({})\n    run.summary.get('x')\n"
              "    summary.world_size\n")
    assert summary_key_reads({"x.py": ast.parse(source)}) == ["x.py:2", "x.py:3"]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (functions' imports included). A package's ``__main__`` is part
    of its package; ``ddptrain`` itself and ``ddptrain.__main__`` are the top."""
    def package(module: str) -> str:
        parts = module.split(".")
        return _unit(module) if len(parts) > 1 and parts[1] != "__main__" else "ddptrain"

    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = package(module)
        packages.setdefault(mine, set()).update(package(d) for d in deps if package(d) != mine)
    for deps in list(packages.values()):
        for d in deps:
            packages.setdefault(d, set())
    return packages


def test_no_package_level_import_cycle_even_through_an_entry_point() -> None:
    assert _cycles(package_graph(import_graph())) == []


def mutual_imports(packages: dict[str, set[str]]) -> list[str]:
    """Every pair of packages that import each other, as ``a <-> b``."""
    return sorted(f"{a} <-> {b}" for a, deps in packages.items() for b in deps if a < b and a in packages.get(b, ()))


def test_no_two_packages_import_each_other() -> None:
    """The folders are the layers: no package (``train`` included) is two layers that import each other."""
    packages = package_graph(import_graph())
    assert mutual_imports(packages) == []
    assert {"step", "plan", "train"} <= set(packages)


def test_the_mutual_import_check_finds_the_trainer_and_planner_importing_each_other() -> None:
    graph = import_graph()
    graph["ddptrain.plan.memory.trace"].add("ddptrain.train.trainer")  # what plan -> train.step was, by folder
    assert "plan <-> train" in mutual_imports(package_graph(graph))


def test_the_package_cycle_check_finds_an_entry_points_cycle() -> None:
    graph = import_graph()
    graph.setdefault("ddptrain.data.__main__", set()).add("ddptrain.app.cli")
    assert any("data" in c and "app" in c for c in _cycles(package_graph(graph)))


def class_definitions(files: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Public class names defined in more than one place -> where."""
    where: dict[str, list[str]] = {}
    for path, tree in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(f"{path}:{node.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1}


def test_no_public_class_name_is_defined_twice() -> None:
    assert class_definitions(_package_files()) == {}


def named_in_guide(text: str) -> list[str]:
    """The files (``ddptrain/...py``, ``tests/...py``, ``scripts/...py``) and tests (``tests/x.py::test_y``, or a
    constant there) a guide names that do not exist."""
    files = re.findall(r"\b((?:ddptrain|tests|scripts)/[\w/.-]+\.py)\b", text)
    missing = [p for p in files if not (REPO / p).is_file()]
    for path, name in re.findall(r"\b(tests/[\w/]+\.py)::(\w+)", text):
        defined = rf"^(def {name}\(|class {name}\b|{name}\s*[:=])"  # a test, a class or a constant
        if (REPO / path).is_file() and not re.search(defined, (REPO / path).read_text(), re.MULTILINE):
            missing.append(f"{path}::{name}")
    return missing


def test_the_extension_guide_names_files_and_tests_that_exist() -> None:
    assert named_in_guide((REPO / "docs" / "extending.md").read_text()) == []


def test_the_guide_check_finds_a_moved_file_and_a_renamed_test() -> None:
    text = "see `ddptrain/train/loop.py` and `tests/test_layout.py::test_no_such_test`"
    assert named_in_guide(text) == ["ddptrain/train/loop.py", "tests/test_layout.py::test_no_such_test"]
