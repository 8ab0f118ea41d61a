"""scripts/mutation_score.py's arithmetic: the sample it checks, the interval it prints for a sampled score, and how
the ranks pass reads its runs and shows them."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def score():
    spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "scripts" / "mutation_score.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def names(module: str, function: str, n: int) -> list[str]:
    return [f"{module}.x_{function}__mutmut_{i}" for i in range(1, n + 1)]


def test_the_sample_takes_n_of_each_package_reproducibly_and_all_of_a_smaller_one(score):
    big = names("ddptrain.train.trainer", "fit", 40) + names("ddptrain.train.drift", "settle", 20)
    plan = names("ddptrain.plan.memory.present", "pick", 30)
    small = names("ddptrain.app.k8s", "render", 3)
    pool = big + plan + small
    chosen = score.sample(pool, 10, seed=1)
    per_package = Counter(score.package_of(score.module_of_mutant(n)) for n in chosen)
    # plan's subpackage is a package of its own; a package with fewer mutants than N is taken whole
    assert per_package == {"train": 10, "plan.memory": 10, "app": 3}
    assert set(small) <= set(chosen) and len(set(chosen)) == len(chosen)
    # reproducible whatever order the names were read in, and another seed draws another sample
    assert score.sample(list(reversed(pool)), 10, seed=1) == chosen
    assert score.sample(pool, 10, seed=2) != chosen
    # both files of train are drawn from: the draw is over the package, not the first file read
    assert {score.module_of_mutant(n) for n in chosen if ".train." in n} == {"ddptrain.train.trainer",
                                                                               "ddptrain.train.drift"}


def test_the_interval_is_wilsons_and_the_table_counts_only_the_checked_mutants(score):
    low, high = score.wilson(80, 100)
    assert (round(low, 4), round(high, 4)) == (0.7112, 0.8666)  # Wilson's 95 % interval of 80 / 100
    assert score.wilson(0, 10)[0] == 0.0 and score.wilson(10, 10)[1] == 1.0 and score.wilson(10, 10)[0] > 0.6
    assert score.wilson(0, 0) == (0.0, 1.0)
    statuses = {n: "killed" for n in names("ddptrain.train.drift", "settle", 8)}
    statuses |= {n: "survived" for n in names("ddptrain.train.drift", "check", 2)}
    statuses |= {n: "not checked" for n in names("ddptrain.train.drift", "later", 90)}
    row = score.table(statuses, sampled=True).splitlines()[2]
    # 8 of the 10 checked: 80 %, not 8 of 100; the interval of 8 / 10
    low, high = score.wilson(8, 10)
    assert row == f"| train | 100 | 8 | 2 | 0 | 0 | 90 | 0 | 80% | {low:.0%}-{high:.0%} |"
    assert "interval" not in score.table(statuses)


def test_the_ranks_pass_reads_pytests_exit_code_as_mutmut_does_and_runs_what_mutmut_runs(score):
    assert [score.ranks_status(rc) for rc in (1, 3, 0, 5, None, 2, 4)] == [
        "ranks killed", "ranks killed", "ranks survived", "no tests", "timeout", "other", "other"]
    settings = {"pytest_add_cli_args": ["-m", "not slow", "-p", "no:xdist"]}
    command = score.ranks_command(["tests/test_drift.py"], settings)
    # the first failure ends the run, in file order, and the fast tier's selection comes last, as in mutmut's runner
    assert command[1:] == ["-m", "pytest", "--rootdir=.", "--tb=native", "-x", "-q", "-p", "no:randomly", "-p",
                           "no:random-order", "tests/test_drift.py", "-m", "not slow", "-p", "no:xdist"]
    assert score.file_of("ddptrain.train.drift") == "ddptrain/train/drift.py"
    assert score.file_of("ddptrain.train") == "ddptrain/train/__init__.py"


def test_the_ranks_pass_shows_its_own_columns_and_yields_to_a_later_mutmut_status(score):
    untested = names("ddptrain.train.drift", "settle", 4)
    statuses = {n: "no tests" for n in untested} | {n: "killed" for n in names("ddptrain.train.drift", "check", 4)}
    ranks = {untested[0]: {"from": "no tests", "status": "ranks killed"},
             untested[1]: {"from": "no tests", "status": "ranks survived"},
             untested[2]: {"from": "no tests", "status": "timeout"}}
    seen = score.with_ranks(statuses, ranks)
    assert [seen[n] for n in untested] == ["ranks killed", "ranks survived", "timeout", "no tests"]
    # the pass runs again what it has not seen killed: the survivor (after new tests) and the unchecked one
    assert score.ranks_todo(statuses, ranks) == sorted([untested[1], untested[3]])
    # 4 killed by mutmut, 1 by the ranks, 1 timeout of 8: 75 %; the ranks' columns follow mutmut's
    lines = score.table(seen).splitlines()
    assert lines[0].endswith("| other | ranks killed | ranks survived | score |")
    assert lines[2] == "| train | 8 | 4 | 0 | 1 | 1 | 0 | 0 | 1 | 1 | 75% |"
    # a later mutmut run that found an in-process test (here: it survived it) wins over the pass's record
    later = statuses | {untested[0]: "survived"}
    assert score.with_ranks(later, ranks)[untested[0]] == "survived"
    assert untested[0] not in score.ranks_todo(later, ranks)


def test_a_module_no_test_imports_is_run_against_the_tests_of_the_modules_that_import_it(score):
    imports = {"ddptrain/train/trainer.py": {"ddptrain.train.observer", "ddptrain.train.observer.StepObserver"},
               "ddptrain/parallel/__init__.py": {"ddptrain.parallel.wrap", "ddptrain.parallel.wrap.wrap_model"},
               "ddptrain/train/drift.py": {"ddptrain.train", "ddptrain.parallel.replicas.rebroadcast"},
               "ddptrain/train/observers.py": {"ddptrain.train.observers"}}
    assert score.importers("ddptrain.train.observer", imports) == ["ddptrain/train/trainer.py"]
    assert score.importers("ddptrain.parallel.replicas", imports) == ["ddptrain/train/drift.py"]
    # a name that only starts like the module is another module
    assert score.importers("ddptrain.train.observe", imports) == []


def test_the_scoped_config_sets_mutmuts_timeout_constant_only_when_asked(score, tmp_path):
    """``--timeout-constant``: the copy's ``[tool.mutmut]`` gets mutmut's ``timeout_constant`` (its wall-clock limit
    is (estimated time + constant) × multiplier); without it the key is absent and mutmut's default holds. The
    other tables and the scope stay as written."""
    import tomllib

    text = '[project]\nname = "x"\n\n[tool.mutmut]\nsource_paths = ["ddptrain"]\n\n[tool.ruff]\nline-length = 120\n'
    asked, default = tmp_path / "asked.toml", tmp_path / "default.toml"
    asked.write_text(text)
    default.write_text(text)
    score.scoped_config(asked, ["ddptrain/train/trainer.py"], ["tests/test_run_summary.py"], ["train"], 30.0)
    score.scoped_config(default, ["ddptrain/train/trainer.py"], ["tests/test_run_summary.py"], ["train"])
    read, plain = tomllib.loads(asked.read_text()), tomllib.loads(default.read_text())
    assert read["tool"]["mutmut"]["timeout_constant"] == 30.0
    assert "timeout_constant" not in plain["tool"]["mutmut"]
    for settings in (read, plain):
        assert settings["tool"]["mutmut"]["only_mutate"] == ["ddptrain/train/trainer.py"]
        assert settings["tool"]["mutmut"]["pytest_add_cli_args_test_selection"] == ["tests/test_run_summary.py"]
        assert settings["tool"]["ruff"] == {"line-length": 120} and settings["project"] == {"name": "x"}
