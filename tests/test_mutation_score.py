"""scripts/mutation_score.py's arithmetic: the sample it checks, the interval it prints for a sampled score, and how
the ranks pass reads its runs and shows them."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

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
    assert row == f"| train | 100 | 8 | 2 | 0 | 0 | 0 | 90 | 0 | 80% | {low:.0%}-{high:.0%} |"
    assert "interval" not in score.table(statuses)


def test_the_ranks_pass_reads_pytests_exit_code_as_mutmut_does_and_runs_what_mutmut_runs(score):
    assert [score.ranks_status(rc) for rc in (1, 3, 0, 5, None, 2, 4)] == [
        "ranks killed", "internal error", "ranks survived", "no tests", "timeout", "other", "other"]
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
    assert lines[2] == "| train | 8 | 4 | 0 | 1 | 1 | 0 | 0 | 0 | 1 | 1 | 75% |"
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
    # every scope's mutants run from mutmut's fork server (forked-rank tests cannot start ranks otherwise)
    assert read["tool"]["mutmut"]["process_isolation"] == plain["tool"]["mutmut"]["process_isolation"] == "forkserver"
    assert "timeout_constant" not in plain["tool"]["mutmut"]
    for settings in (read, plain):
        assert settings["tool"]["mutmut"]["only_mutate"] == ["ddptrain/train/trainer.py"]
        assert settings["tool"]["mutmut"]["pytest_add_cli_args_test_selection"] == ["tests/test_run_summary.py"]
        assert settings["tool"]["ruff"] == {"line-length": 120} and settings["project"] == {"name": "x"}


def test_pytests_internal_error_is_a_column_of_its_own_and_no_kill(score, tmp_path):
    """mutmut counts pytest's exit 3 as a kill; the script reads it from mutmut's records as "internal error",
    beside the kills and outside the score (5 killed of 6 checked: 83 %, where counting the three as kills gave
    8 of 9)."""
    meta = tmp_path / "mutants" / "ddptrain" / "train" / "drift.py.meta"
    meta.parent.mkdir(parents=True)
    codes = dict.fromkeys(names("ddptrain.train.drift", "settle", 5), 1) | {"ddptrain.train.drift.x_check__mutmut_1": 0}
    codes |= dict.fromkeys(names("ddptrain.train.drift", "later", 3), 3)
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    statuses = score.results(tmp_path)
    assert Counter(statuses.values()) == {"killed": 5, "survived": 1, "internal error": 3}
    lines = score.table(statuses).splitlines()
    assert lines[0] == ("| package | mutants | killed | survived | no tests | timeout | internal error | not checked "
                        "| other | score |")
    assert lines[2] == "| train | 9 | 5 | 1 | 0 | 0 | 3 | 0 | 0 | 83% |"


def test_run_tests_passes_the_mutant_to_the_run_and_reads_a_run_past_its_limit_as_none(score):
    """The mutant reaches the command through ``MUTANT_UNDER_TEST``; a run killed at its limit is None (a timeout),
    not the kill's exit code (-9 would read as other)."""
    check = ["sh", "-c", 'test "$MUTANT_UNDER_TEST" = ddptrain.x.x_f__mutmut_1 && exit 7; exit 0']
    assert score.run_tests(check, ROOT, "ddptrain.x.x_f__mutmut_1", 60) == 7
    assert score.run_tests(check, ROOT, "", 60) == 0
    assert score.run_tests(["sleep", "30"], ROOT, "", 0.3) is None


def test_the_ranks_pass_checks_only_after_a_clean_pass_and_gives_each_mutant_two_minutes_over_five_cleans(
        score, tmp_path, monkeypatch):
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "pyproject.toml").write_text('[tool.mutmut]\npytest_add_cli_args = ["-m", "not slow"]\n')
    untested = names("ddptrain.train.drift", "settle", 2)
    statuses = {n: "no tests" for n in untested} | {"ddptrain.train.drift.x_check__mutmut_1": "killed"}
    monkeypatch.setattr(score, "ranks_selection", lambda file: ["tests/test_drift.py"])
    runs: list[tuple[str, float | None]] = []
    codes = {"": 5}

    def run_tests(command, cwd, mutant, timeout):
        runs.append((mutant, timeout))
        return codes.get(mutant, 1)

    monkeypatch.setattr(score, "run_tests", run_tests)
    # the clean run selected nothing (5): no mutant is checked, none recorded
    assert score.ranks_pass(tmp_path, statuses) == {} and runs == [("", None)]
    codes[""] = 0
    runs.clear()
    ranks = score.ranks_pass(tmp_path, statuses)
    assert ranks == {n: {"from": "no tests", "status": "ranks killed"} for n in untested}
    assert [m for m, _ in runs] == ["", *untested]
    # the clean run here is instant: each mutant's limit is the two minutes (and five times next to nothing)
    assert all(120 <= t < 125 for _, t in runs[1:])
    assert json.loads((tmp_path / score.RANKS_FILE).read_text()) == ranks


def test_the_survivors_file_shows_each_survivor_and_each_mutant_no_test_reached_with_its_status(score, tmp_path):
    source = tmp_path / "mutants" / "ddptrain" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("def x_f__mutmut_orig(a):\n    return a + 1\n\n\ndef x_f__mutmut_1(a):\n    return a - 1\n\n\n"
                      "def x_f__mutmut_2(a):\n    return a + 2\n\n\ndef x_f__mutmut_3(a):\n    return a * 1\n")
    statuses = {"ddptrain.x.x_f__mutmut_1": "no tests", "ddptrain.x.x_f__mutmut_2": "survived",
                "ddptrain.x.x_f__mutmut_3": "killed"}
    text = score.survivors(tmp_path, statuses)
    assert "### ddptrain.x.x_f__mutmut_1 (no tests)" in text and "+    return a - 1" in text
    assert "### ddptrain.x.x_f__mutmut_2 (survived)" in text and "mutmut_3" not in text


class Main:
    """``main()`` on a work directory mutmut already filled (``mutants/**.py.meta``), with the copy and mutmut's runs
    replaced: what it asks mutmut to run, what it prints."""

    def __init__(self, score, tmp_path, monkeypatch, capsys, codes: dict[str, int | None]) -> None:
        self.score, self.work, self.monkeypatch, self.capsys = score, tmp_path / "work", monkeypatch, capsys
        meta = self.work / "mutants" / "ddptrain" / "testing" / "faults.py.meta"
        meta.parent.mkdir(parents=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
        self.runs: list[list[str]] = []
        self.copies = 0
        monkeypatch.setattr(score, "copy_tree", self.copy_tree)
        monkeypatch.setattr(score, "subprocess", SimpleNamespace(run=self.run))

    def copy_tree(self, work: Path) -> None:
        self.copies += 1
        (work / "pyproject.toml").write_text('[tool.mutmut]\npytest_add_cli_args = ["-m", "not slow"]\n')
        (work / "tests").mkdir(exist_ok=True)
        (work / "tests" / "test_new.py").write_text(f"# copy {self.copies}\n")

    def run(self, command, **kwargs):
        self.runs.append(command)
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    def __call__(self, *flags: str) -> str:
        self.monkeypatch.setattr(sys, "argv", ["mutation_score.py", "ddptrain/testing/faults.py", "--tests",
                                               "package", "--work", str(self.work), *flags])
        self.runs.clear()
        assert self.score.main() == 0
        return self.capsys.readouterr().out

    def checked(self) -> list[str] | None:
        """The mutants of the one ``mutmut run`` (None: all of them, no names given)."""
        assert len(self.runs) == 1, f"expected one mutmut run, got {self.runs}"
        run = self.runs[0]
        named = run[run.index("--max-children") + 2:]
        return named or None


def test_main_rechecks_only_the_mutants_of_the_statuses_asked_for_and_runs_nothing_when_none_has_them(
        score, tmp_path, monkeypatch, capsys):
    faults = "ddptrain.testing.faults"
    codes = {f"{faults}.x_parse_fault__mutmut_1": 0, f"{faults}.x_parse_fault__mutmut_2": 1,
             f"{faults}.x_parse_fault__mutmut_3": 33, f"{faults}.x_parse_fault__mutmut_4": 0}
    main = Main(score, tmp_path, monkeypatch, capsys, codes)
    out = main("--recheck", "survived,no tests")
    assert main.checked() == [f"{faults}.x_parse_fault__mutmut_{i}" for i in (1, 3, 4)]
    assert "checking 3 of 4 mutants" in out and "interval" not in out  # a recheck is no sample
    main("--recheck", "timeout")
    assert main.runs == []  # nothing to recheck: not a run of every mutant
    main()
    assert main.checked() is None  # no --recheck nor --sample: mutmut runs them all
    out = main("--sample", "2", "--seed", "3")
    assert len(main.checked()) == 2 and "95 % interval" in out


def test_main_refuses_bad_flags_in_one_line_and_takes_a_recheck_of_statuses_with_spaces(score, monkeypatch, capsys):
    for flags, message in ((["--timeout-constant", "0"], "--timeout-constant: expected a positive number"),
                           (["--sample", "0"], "--sample: expected a positive number"),
                           (["--recheck", "survived,bogus"], "--recheck: expected statuses among"),
                           (["--recheck", "survived,no tests"], "nothing to mutate")):
        monkeypatch.setattr(sys, "argv", ["mutation_score.py", *flags])
        with pytest.raises(SystemExit) as exit_:
            score.main()
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_ranks_only_runs_the_pass_with_the_checkouts_tests_as_they_are_now(score, tmp_path, monkeypatch, capsys):
    main = Main(score, tmp_path, monkeypatch, capsys, {"ddptrain.testing.faults.x_parse_fault__mutmut_1": 33})
    (main.work / "mutants" / "tests").mkdir()
    (main.work / "tests").mkdir()
    (main.work / "tests" / "test_new.py").write_text("# the last run's copy\n")
    seen: list[str] = []

    def ranks_pass(work, statuses):
        seen.append((work / "mutants" / "tests" / "test_new.py").read_text())
        assert statuses == {"ddptrain.testing.faults.x_parse_fault__mutmut_1": "no tests"}
        return {}

    monkeypatch.setattr(score, "ranks_pass", ranks_pass)
    main("--ranks-only")
    assert main.runs == [] and seen == ["# copy 1\n"]


def test_a_recheck_keeps_the_selection_its_stats_were_collected_with(score, tmp_path, capsys):
    """mutmut resets every result when its test selection changes: a recheck runs the kept work directory's test
    files and names the ones added since; a work directory without a selection (new, or whole-package ``tests``)
    takes today's."""
    today = ["tests/test_a.py", "tests/test_b.py", "tests/test_new.py"]
    assert score.kept_selection(tmp_path, today) == today  # no work directory yet
    (tmp_path / "pyproject.toml").write_text(
        '[tool.mutmut]\npytest_add_cli_args_test_selection = ["tests/test_a.py", "tests/test_b.py"]\n')
    assert score.kept_selection(tmp_path, today) == ["tests/test_a.py", "tests/test_b.py"]
    assert capsys.readouterr().out.strip().endswith("not run: tests/test_new.py")
    assert score.kept_selection(tmp_path, today[:2]) == today[:2] and capsys.readouterr().out == ""
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\npytest_add_cli_args_test_selection = ["tests"]\n')
    assert score.kept_selection(tmp_path, today) == today
