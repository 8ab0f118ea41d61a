"""The mutation score of ddptrain's fast tier by mutmut, for the files a change touches or for whole packages.

    python scripts/mutation_score.py --base main                       # the ddptrain files changed since main
    python scripts/mutation_score.py ddptrain/runtime/allocator.py ddptrain/diagnose
    python scripts/mutation_score.py ddptrain/diagnose --survivors survivors.md

mutmut (the ``mutation`` extra: ``pip install -e .[mutation]``) writes every mutant it can make of a function into a
copy of the tree (``mutants/``) behind a trampoline, runs the tests once to learn which tests call which function,
then runs, for each mutant, only the tests that called its function, in processes forked from its own. Its
settings are ``[tool.mutmut]`` in pyproject.toml; they cover all of ``ddptrain`` (``mutmut run`` in the checkout
does that, hours on 2 cores). This script narrows them to a scope without touching the checkout: it copies the
tracked and untracked files to a work directory (``.mutation/``, ignored by git), writes the scope into that
copy's ``[tool.mutmut]`` (the files to mutate; the fast tier of the test files that import them, or with
``--tests package`` every fast test whose package marks name their packages: ``tests/helpers/package_marks.py``),
runs ``mutmut run`` there (one child at a time unless ``--max-children``, at ``nice -n 19``), and prints per
package, as a markdown table, the mutants killed, survived, with no tests, timed out, not checked (a run stopped
early; ``--table-only`` prints what a work directory holds) and other. The score is killed and timed out over
checked.

``--sample N`` checks a uniform random sample of N mutants per package (``--seed``), not all of them: the score of
a sample estimates the package's without a bias of anyone's choosing, and the table gives its 95 % interval (Wilson).
mutmut has no command that only generates mutants, so a first ``mutmut run`` filtered on a name no mutant has
generates them and collects the stats, then stops (mutmut asserts the filter matched); the sample is drawn from
the names that run wrote, and a second ``mutmut run NAMES…`` checks them. ``--recheck STATUS[,STATUS]`` checks again
only the mutants a kept work directory holds with those statuses (``survived,no tests`` after new tests: a killed
mutant stays killed when tests are added).

"no tests" are mutants of functions no selected test calls in the pytest process: code run only by a forked rank
or a subprocess counts there (mutmut records which tests reach a function in its own process only). They count
against the score unless ``--ranks`` checks them: the ranks pass runs each such mutant of the run against the fast
tier of the test files that import its module (``MUTANT_UNDER_TEST`` set: forked ranks inherit it and import the
copy too), after a clean run of that selection passed, and shows it as "ranks killed" (the run failed) or "ranks
survived" (it passed), kept in ``ranks.json`` in the work directory (``--ranks-only``: that pass alone on a kept
work directory, after new tests). docs/mutation.md has what a run costs and the triage of the survivors.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.package_marks import imported_names, packages_named  # noqa: E402 (the checkout's helpers)

# mutmut's exit codes (mutmut.stats.status_by_exit_code, which is not a public API: repeated here), folded into
# the columns of the table. One is read otherwise: mutmut counts pytest's exit 3, an INTERNALERROR, as a kill, but
# it says the harness broke around the tests, not that a test saw the mutant (under mutmut's default "fork"
# isolation every mutant whose tests fork ranks ended so: see ``scoped_config``); it is a column of its own,
# counted neither way, to be checked again.
STATUS = {1: "killed", 3: "internal error", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "type check"}
COLUMNS = ("killed", "survived", "no tests", "timeout", "internal error", "not checked", "other")
# what the ranks pass (--ranks) found for a mutant mutmut left with no tests: columns of their own, beside mutmut's
RANKS_COLUMNS = ("ranks killed", "ranks survived")
RANKS_FILE = "ranks.json"  # in the work directory: {mutant: {"from": mutmut's status, "status": the pass's}}


def changed_files(base: str) -> list[str]:
    """The Python files under ddptrain/ that differ from ``base`` (committed or not), and still exist."""
    out = subprocess.run(["git", "diff", "--name-only", base, "--", "ddptrain"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return sorted(f for f in out.split() if f.endswith(".py") and (REPO / f).is_file())


def python_files(paths: list[str]) -> list[str]:
    """Each path as the Python files it names (a directory: every file under it), relative to the checkout."""
    files: set[str] = set()
    for p in paths:
        path = (REPO / p).resolve()
        if not path.exists() or REPO / "ddptrain" not in (path, *path.parents):
            raise SystemExit(f"mutation_score: {p}: expected a file or directory under ddptrain/")
        found = [path] if path.is_file() else sorted(path.rglob("*.py"))
        files |= {str(f.relative_to(REPO)) for f in found if f.suffix == ".py"}
    return sorted(files)


def module_of(file: str) -> str:
    """``ddptrain/plan/memory/trace.py`` -> ``ddptrain.plan.memory.trace``."""
    return file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def package_of(module: str) -> str:
    """The row a module's mutants are counted in: its package below ddptrain (plan's subpackages apart)."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "plan":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 2 else module


def marks_of(files: list[str]) -> list[str]:
    """The package marks whose tests run against these files (``plan_memory`` for plan/memory, and so on)."""
    marks: set[str] = set()
    for f in files:
        named = packages_named({module_of(f)})
        # plan's subpackages have marks of their own: the narrower one selects the tests that use the file
        marks |= {m for m in named if m.startswith("plan_")} or named
    return sorted(marks)


def test_files_of(files: list[str]) -> list[str]:
    """The test files that import one of these modules themselves (``from M import x`` or ``import M``)."""
    modules = {module_of(f) for f in files}
    found = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        names = imported_names(path)
        if any(n == m or n.startswith(m + ".") for n in names for m in modules):
            found.append(str(path.relative_to(REPO)))
    return found


def copy_tree(work: Path) -> None:
    """The checkout's tracked and untracked files (not ignored ones) into ``work``, as scripts/mutate.py does."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return str(value)


def scoped_config(pyproject: Path, files: list[str], tests: list[str] | None, marks: list[str],
                  timeout_constant: float | None = None) -> None:
    """Rewrite the copy's ``[tool.mutmut]``: only ``files`` mutated; the fast tier of ``tests`` (test files) run,
    or with ``tests`` None, the fast tests whose package marks are ``marks``; ``timeout_constant``: mutmut's
    seconds added to a mutant's estimated test time before its timeout multiplier (None: mutmut's default)."""
    text = pyproject.read_text()
    settings = dict(tomllib.loads(text)["tool"]["mutmut"])
    settings["only_mutate"] = files
    # Each mutant's tests run in a process forked from a fork server that has only collected them, not from
    # mutmut's own process: that one ran the stats and clean runs, whose forked-rank tests started
    # tests/helpers/dist.py's multiprocessing fork server. A process forked from it inherits that server's pid but
    # is not its parent, so starting a rank there fails in os.waitpid (ChildProcessError), in a pytest hook before
    # any test: pytest's exit 3 for every such mutant, which mutmut reads as killed.
    settings["process_isolation"] = "forkserver"
    if timeout_constant is not None:
        settings["timeout_constant"] = timeout_constant
    if tests is not None:
        settings["pytest_add_cli_args_test_selection"] = tests
    else:
        args = list(settings.get("pytest_add_cli_args", []))
        where = args.index("-m")  # the fast tier's `-m "not slow"`, narrowed to the scope's packages
        args[where + 1] = f"({' or '.join(marks)}) and ({args[where + 1]})"
        settings["pytest_add_cli_args"] = args
    start = text.index("[tool.mutmut]")
    end = text.find("\n[", start + 1)
    table = "[tool.mutmut]\n" + "".join(f"{key} = {toml_value(v)}\n" for key, v in settings.items()) + "\n"
    pyproject.write_text(text[:start] + table + (text[end + 1:] if end != -1 else ""))


def kept_selection(work: Path, tests: list[str]) -> list[str]:
    """For a recheck, the test files the work directory's stats were collected with, not ``tests`` (today's): mutmut
    resets every result and collects every stat again when its test selection changes (its config fingerprint),
    which would turn a recheck of a few mutants into a whole run. New tests in those files are still run (mutmut
    collects the stats of new tests only); test files added since are not, and are named."""
    pyproject = work / "pyproject.toml"
    if not pyproject.is_file():
        return tests
    kept = tomllib.loads(pyproject.read_text()).get("tool", {}).get("mutmut", {}).get(
        "pytest_add_cli_args_test_selection")
    if not kept or kept == ["tests"]:
        return tests
    if added := sorted(set(tests) - set(kept)):
        print(f"recheck: the work directory's {len(kept)} test files kept (a new selection would reset every "
              f"result); not run: {' '.join(added)}", flush=True)
    return list(kept)


def results(work: Path) -> dict[str, str]:
    """Each mutant's status, from mutmut's per-file records (``mutants/<file>.meta``)."""
    statuses: dict[str, str] = {}
    for meta in (work / "mutants").rglob("*.py.meta"):
        for name, code in json.loads(meta.read_text()).get("exit_code_by_key", {}).items():
            statuses[name] = "not checked" if code is None else STATUS.get(code, "other")
    return statuses


def table(statuses: dict[str, str], sampled: bool = False) -> str:
    """Per package: the mutants in each column and the score; ``sampled``: the score's 95 % interval too (the
    statuses are a random sample's, and the not checked ones are the mutants outside it). The ranks pass's
    columns appear when a status is one of theirs."""
    columns = COLUMNS + (RANKS_COLUMNS if set(RANKS_COLUMNS) & set(statuses.values()) else ())
    per_package: dict[str, Counter[str]] = defaultdict(Counter)
    for name, status in statuses.items():
        per_package[package_of(module_of_mutant(name))][status if status in columns else "other"] += 1
    head = "| package | mutants | " + " | ".join(columns) + " | score |" + (" 95 % interval |" if sampled else "")
    lines = [head, "|---|" + "---:|" * (len(columns) + 2 + sampled)]
    totals: Counter[str] = Counter()
    for package, counts in sorted(per_package.items()):
        totals.update(counts)
        lines.append(_row(package, counts, columns, sampled))
    if len(per_package) > 1:
        lines.append(_row("**all**", totals, columns, sampled))
    return "\n".join(lines)


def _row(package: str, counts: Counter[str], columns: tuple[str, ...], sampled: bool = False) -> str:
    n = sum(counts.values())
    # a timeout is a kill (the mutant changed what the tests saw: they did not finish); no tests is not; a run
    # stopped early leaves mutants not checked, and an internal error leaves them unchecked too: neither counts
    # either way; a mutant the ranks pass saw fail the tests is killed, one it saw pass them survived
    checked = n - counts["not checked"] - counts["internal error"]
    killed = counts["killed"] + counts["timeout"] + counts["ranks killed"]
    score = killed / checked if checked else 0.0
    row = f"| {package} | {n} | " + " | ".join(str(counts[c]) for c in columns) + f" | {score:.0%} |"
    if sampled:
        low, high = wilson(killed, checked)
        row += f" {low:.0%}-{high:.0%} |"
    return row


def wilson(killed: int, checked: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion ``killed / checked`` (sound at 0 and 1, unlike the normal
    approximation)."""
    if checked == 0:
        return 0.0, 1.0
    p = killed / checked
    centre = (p + z * z / (2 * checked)) / (1 + z * z / checked)
    half = z * math.sqrt(p * (1 - p) / checked + z * z / (4 * checked * checked)) / (1 + z * z / checked)
    return max(0.0, centre - half), min(1.0, centre + half)


def sample(names: list[str], per_package: int, seed: int) -> list[str]:
    """A uniform random sample of ``per_package`` mutants of each package (all of a package that has fewer),
    reproducible from ``seed``: the names sorted first, so the draw does not depend on the order files were read."""
    by_package: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        by_package[package_of(module_of_mutant(name))].append(name)
    rng = random.Random(seed)
    chosen: list[str] = []
    for package in sorted(by_package):
        members = by_package[package]
        chosen += members if len(members) <= per_package else rng.sample(members, per_package)
    return sorted(chosen)


def file_of(module: str) -> str:
    """``ddptrain.train.drift`` -> ``ddptrain/train/drift.py`` (a package: its ``__init__.py``)."""
    path = module.replace(".", "/")
    return path + "/__init__.py" if (REPO / path).is_dir() else path + ".py"


def importers(module: str, imports: dict[str, set[str]]) -> list[str]:
    """The files whose imports (``imports``: each file's ``imported_names``) name ``module`` or a name in it."""
    return sorted(f for f, names in imports.items() if any(n == module or n.startswith(module + ".") for n in names))


def ranks_selection(file: str) -> list[str]:
    """The test files a ranks run of ``file``'s mutants runs: those that import its module, or where none does
    (``train/observer.py``, reached through the trainer), those that import a ddptrain module importing it."""
    tests = test_files_of([file])
    if tests:
        return tests
    imports = {str(f.relative_to(REPO)): imported_names(f) for f in sorted((REPO / "ddptrain").rglob("*.py"))}
    return test_files_of([f for f in importers(module_of(file), imports) if f != file])


def ranks_command(tests: list[str], settings: dict[str, object]) -> list[str]:
    """One ranks run's pytest command, as mutmut's runner builds its own (``PytestRunner.execute_pytest`` and
    ``_pytest_args_regular_run``): ``--rootdir=. --tb=native -x -q`` without random order, the test files, then
    ``[tool.mutmut]``'s ``pytest_add_cli_args`` (the fast tier, no xdist, no budget, the deselected tests)."""
    added = settings.get("pytest_add_cli_args", [])
    assert isinstance(added, list)
    return [sys.executable, "-m", "pytest", "--rootdir=.", "--tb=native", "-x", "-q", "-p", "no:randomly",
            "-p", "no:random-order", *tests, *map(str, added)]


def ranks_status(returncode: int | None) -> str:
    """A ranks run's pytest exit code as a status, read as ``STATUS`` reads mutmut's: a failure kills (1), a clean
    pass survives (0), pytest's internal error (3) is the harness's and counts neither way, nothing selected
    leaves it with no tests (5), a run past its limit (None) is a timeout (a kill, as mutmut counts one), anything
    else (2: a collection error or an interruption) is other."""
    if returncode is None:
        return "timeout"
    return {0: "ranks survived", 1: "ranks killed", 3: "internal error", 5: "no tests"}.get(returncode, "other")


def with_ranks(statuses: dict[str, str], ranks: dict[str, dict[str, str]]) -> dict[str, str]:
    """mutmut's statuses, each mutant the ranks pass checked shown with what that pass found, as long as mutmut's
    status is still the one the pass started from (a later mutmut run that finds a test in-process wins)."""
    return {name: ranks[name]["status"] if name in ranks and ranks[name]["from"] == status else status
            for name, status in statuses.items()}


def ranks_todo(statuses: dict[str, str], ranks: dict[str, dict[str, str]]) -> list[str]:
    """The mutants the ranks pass runs: mutmut left them with no tests, and the pass has not yet seen them killed
    (a killed mutant stays killed when tests are added; one that survived is run again)."""
    seen = with_ranks(statuses, ranks)
    return sorted(n for n, s in statuses.items() if s == "no tests" and seen[n] not in ("ranks killed", "timeout"))


def run_tests(command: list[str], cwd: Path, mutant: str, timeout: float | None) -> int | None:
    """``command`` in ``cwd`` with ``MUTANT_UNDER_TEST`` set (the trampolines read it in every process that inherits
    the environment, forked ranks included), at ``nice -n 19``; its exit code, or None past ``timeout`` (its whole
    process group is killed: ranks and the fork server too)."""
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
    process = subprocess.Popen(["nice", "-n", "19", *command], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        return None


def ranks_pass(work: Path, statuses: dict[str, str]) -> dict[str, dict[str, str]]:
    """Run each mutant mutmut left with no tests against the fast tier of the test files that import its module
    (``ranks_selection``), in the work directory's ``mutants/`` copy, and record what happened in ``ranks.json``.

    mutmut learns which tests call a function only in the pytest process; a function that only forked ranks
    (``tests/helpers/dist.py``) or in-process threads mutmut does not trace run is "no tests" there, yet the ranks
    import the copy and inherit ``MUTANT_UNDER_TEST``. Each selection runs clean first (``MUTANT_UNDER_TEST`` empty)
    and must pass: its mutants are not checked otherwise. A mutant's run is limited to five times the clean run's
    wall time and two minutes more."""
    path = work / RANKS_FILE
    ranks: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    settings = tomllib.loads((work / "mutants" / "pyproject.toml").read_text())["tool"]["mutmut"]
    by_selection: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for name in ranks_todo(statuses, ranks):
        by_selection[tuple(ranks_selection(file_of(module_of_mutant(name))))].append(name)
    for tests, names in sorted(by_selection.items()):
        if not tests:
            continue
        command = ranks_command(list(tests), settings)
        begin = time.monotonic()
        clean = run_tests(command, work / "mutants", "", None)
        took = time.monotonic() - begin
        print(f"ranks: {len(names)} mutants; the clean run of {' '.join(tests)} took {took:.0f} s, exited {clean}",
              flush=True)
        if clean != 0:
            print("ranks: the clean run failed: these mutants are not checked", flush=True)
            continue
        for name in names:
            status = ranks_status(run_tests(command, work / "mutants", name, 5 * took + 120))
            ranks[name] = {"from": "no tests", "status": status}
            path.write_text(json.dumps(ranks, indent=1, sort_keys=True) + "\n")
            print(f"  {status}: {name}", flush=True)
    return ranks


def survivors(work: Path, statuses: dict[str, str]) -> str:
    """Each surviving mutant as a diff against the original function, read from mutmut's mutated file (where
    ``<function>__mutmut_<n>`` sits beside ``<function>__mutmut_orig``): what ``mutmut show`` prints, without a
    process per mutant (``mutmut show`` takes 10 s each on a busy machine)."""
    sources: dict[str, dict[str, str]] = {}
    parts = []
    for name, status in sorted((n, s) for n, s in statuses.items() if s in ("survived", "ranks survived", "no tests")):
        module = module_of_mutant(name)
        if module not in sources:
            path = work / "mutants" / (module.replace(".", "/") + ".py")
            text = path.read_text()
            lines = text.splitlines()
            sources[module] = {node.name: "\n".join(lines[node.lineno - 1:node.end_lineno])
                               for node in ast.walk(ast.parse(text))
                               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        function = name[len(module) + 1:]
        original = sources[module].get(function.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "")
        mutated = sources[module].get(function, "")
        diff = difflib.unified_diff(original.replace("__mutmut_orig", "").splitlines(),
                                    mutated.replace(function, function.rsplit("__mutmut_", 1)[0]).splitlines(),
                                    lineterm="", n=1)
        body = "\n".join(line for line in list(diff)[2:])
        parts.append(f"### {name} ({status})\n\n```diff\n{body}\n```\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or directories under ddptrain/ to mutate")
    parser.add_argument("--base", help="mutate the ddptrain files changed since this commit (git diff --name-only)")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--work", type=Path, default=REPO / ".mutation",
                        help="the copy mutmut runs in (default .mutation/; kept: a rerun of the same scope only "
                             "tests what changed)")
    parser.add_argument("--tests", choices=("files", "package"), default="files",
                        help="files (default): the test files that import a mutated module; package: every fast test "
                             "marked with its package (kills through callers too, several times the cost)")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: the table (and --survivors) of what the work directory holds")
    parser.add_argument("--survivors", type=Path, help="write each survivor's diff to this markdown file")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="check a uniform random sample of N mutants per package, not all (the table gives the "
                             "score's 95 %% interval)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--ranks", action="store_true",
                        help="then run each mutant mutmut left with no tests against the fast tier of the test files "
                             "that import its module, forked ranks included (ranks.json in the work directory)")
    parser.add_argument("--ranks-only", action="store_true",
                        help="the ranks pass alone, on a kept work directory (the checkout's tests copied in first)")
    parser.add_argument("--recheck", metavar="STATUS[,STATUS]",
                        help="check again only the mutants the work directory holds with these statuses, e.g. "
                             "'survived,no tests' after new tests")
    parser.add_argument("--timeout-constant", type=float, metavar="S",
                        help="seconds mutmut adds to a mutant's estimated test time before multiplying it by its "
                             "timeout_multiplier (15) into the wall-clock limit (mutmut's default 1): a test whose "
                             "time the stats underestimated (one in-process training run at nice 19 beside other "
                             "jobs) then finishes instead of timing out. mutmut re-checks only the timed-out "
                             "mutants when this changes")
    args = parser.parse_args()
    if args.timeout_constant is not None and args.timeout_constant <= 0:
        parser.error("--timeout-constant: expected a positive number of seconds")
    if args.sample is not None and args.sample < 1:
        parser.error("--sample: expected a positive number of mutants per package")
    recheck = set(args.recheck.split(",")) if args.recheck else set()
    if recheck - set(COLUMNS):
        parser.error(f"--recheck: expected statuses among {', '.join(COLUMNS)}")
    files = (changed_files(args.base) if args.base else []) + (python_files(args.paths) if args.paths else [])
    if not files:
        parser.error("nothing to mutate: name files or directories under ddptrain/, or --base with changes")
    files = sorted(set(files))
    marks = marks_of(files)
    tests = test_files_of(files) if args.tests == "files" else None
    if tests == []:
        parser.error("no test file imports these modules: use --tests package")
    if recheck and tests is not None and not args.table_only:
        tests = kept_selection(args.work, tests)
    modules = {module_of(f) for f in files}
    mutmut = [sys.executable, "-m", "mutmut"]
    returncode = 0
    if not args.table_only and not args.ranks_only:
        args.work.mkdir(parents=True, exist_ok=True)
        copy_tree(args.work)
        scoped_config(args.work / "pyproject.toml", files, tests, marks, args.timeout_constant)
        chosen = " ".join(tests) if tests is not None else f"marked {' or '.join(marks)}"
        print(f"mutating {len(files)} files; tests: the fast tier of {chosen}", flush=True)
        begin, cpu0 = time.monotonic(), os.times()
        run = ["nice", "-n", "19", *mutmut, "run", "--max-children", str(args.max_children)]
        names: list[str] | None = None
        if args.sample is not None or recheck:
            if not results(args.work):
                # generate the mutants and collect the stats only: no mutant has this name (mutmut then stops on
                # its assertion that the filter matched, exit 1)
                generated = subprocess.run([*run, "generate-only-no-mutant-has-this-name"], cwd=args.work,
                                           capture_output=True, text=True)
                if not results(args.work):
                    print(generated.stdout[-4000:], generated.stderr[-4000:], sep="\n")
                    raise SystemExit("mutation_score: mutmut generated no mutants (its output is above)")
            in_scope = scoped(results(args.work), modules)
            pool = [n for n, s in in_scope.items() if not recheck or s in recheck]
            names = sample(pool, args.sample, args.seed) if args.sample is not None else sorted(pool)
            print(f"checking {len(names)} of {len(in_scope)} mutants", flush=True)
        returncode = subprocess.run(run + (names or []), cwd=args.work).returncode if names != [] else 0
        cpu1 = os.times()
        cpu = cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system
        print(f"\n{time.monotonic() - begin:.0f} wall s, {cpu / 60:.1f} CPU min (mutmut exited {returncode})\n")
    statuses = scoped(results(args.work), modules)
    if (args.ranks or args.ranks_only) and not args.table_only:
        if args.ranks_only:
            # the checkout's tests as they are now, into the copy mutmut runs in (mutmut copies them on each run)
            copy_tree(args.work)
            shutil.copytree(args.work / "tests", args.work / "mutants" / "tests", dirs_exist_ok=True)
        begin, cpu0 = time.monotonic(), os.times()
        ranks_pass(args.work, statuses)
        cpu1 = os.times()
        cpu = cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system
        print(f"\nranks pass: {time.monotonic() - begin:.0f} wall s, {cpu / 60:.1f} CPU min\n")
    ranks_file = args.work / RANKS_FILE
    statuses = with_ranks(statuses, json.loads(ranks_file.read_text()) if ranks_file.exists() else {})
    print(table(statuses, sampled=args.sample is not None))
    if args.survivors:
        args.survivors.write_text(survivors(args.work, statuses))
        print(f"\nsurvivors' diffs: {args.survivors}")
    return returncode


def scoped(statuses: dict[str, str], modules: set[str]) -> dict[str, str]:
    """The statuses of the mutants of ``modules`` (a work directory may hold mutants of a wider earlier scope)."""
    return {name: status for name, status in statuses.items() if module_of_mutant(name) in modules}


def module_of_mutant(name: str) -> str:
    """``ddptrain.runtime.allocator.x_read__mutmut_3`` -> ``ddptrain.runtime.allocator`` (methods: ``.xǁClassǁ``)."""
    return name.split(".x_")[0].split(".xǁ")[0]


if __name__ == "__main__":
    sys.exit(main())
