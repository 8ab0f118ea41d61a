"""The suite's own machinery: the fast tier's time budget, tests sharing a module fixture kept on one xdist worker,
each CLI run once per session, and the package marks that find a module's tests."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import collector, package_marks, run_cache, timing, xdist_groups, xdist_threads
from tests.helpers.dist import run_distributed

REPO = Path(__file__).parents[1]

BUSY_AND_IDLE = """
import time
import pytest

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_computes():
    burn(0.4)

def test_waits():
    time.sleep(0.4)

@pytest.mark.slow
def test_slow_computes():
    burn(0.4)

def test_quick():
    pass
"""


def _with_timing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["tests.helpers.timing"]\n')
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow tier\n")
    pytester.makepyfile(test_budget=BUSY_AND_IDLE)


def test_a_fast_test_over_its_cpu_budget_fails_and_one_that_only_waits_is_reported_not_failed(
    pytester: pytest.Pytester,
) -> None:
    _with_timing(pytester)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--test-budget-s=0.2")
    result.assert_outcomes(passed=3, failed=1)  # the waiting, the slow tier's and the quick test pass
    result.stdout.fnmatch_lines(["over the fast tier's budget: 0.4 CPU s (budget 0.2; * wall s at * per core)*",
                                 "*fast-tier tests over the budget in wall seconds (reported, not failed)*",
                                 "*test_budget.py::test_waits", "FAILED test_budget.py::test_computes*"])
    listed = result.stdout.str().split("over the budget in wall seconds")[1].split("short test summary")[0]
    assert "test_quick" not in listed and "test_slow_computes" not in listed


# A test that computes 0.07 CPU s while the machine is crowded: its thread is pinned to one core and lowered to nice
# 15, beside a busy process on that core that is no descendant of the test (started through a shell that exits, so
# init adopts it and its CPU is not the test's). It gets a few percent of the core: a second or more of wall time
# for 0.07 CPU s, whatever the load average says (it hardly moves in a second).
CROWDED = """
import os, signal, subprocess, sys, threading, time

BUSY = "import time\\nend = time.time() + 30\\nwhile time.time() < end:\\n    pass"

def test_crowded():
    core = min(os.sched_getaffinity(0))
    pid = int(subprocess.check_output(
        ["sh", "-c", f"taskset -c {core} {sys.executable} -c '{BUSY}' >/dev/null 2>&1 & echo $!"]))
    begin = time.perf_counter()

    def work():
        os.sched_setaffinity(0, {core})
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)  # this thread only (Linux)
        end = time.thread_time() + 0.07
        while time.thread_time() < end:
            pass

    try:
        time.sleep(0.1)  # the busy process is running
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        os.kill(pid, signal.SIGKILL)
    print(f"crowded wall {time.perf_counter() - begin:.2f}")
"""


def test_a_test_slowed_by_the_load_passes_when_its_cpu_is_within_the_budget(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["tests.helpers.timing"]\n')
    pytester.makepyfile(test_crowded=CROWDED)
    out = pytester.path / "timing.json"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s", "--test-budget-s=0.15",
                                          f"--timing-json={out}")
    figures = json.loads(out.read_text())["test_crowded.py::test_crowded"]
    # over the budget in wall seconds, within it in CPU: by construction, the 0.1 s sleep and 0.07 CPU s of work put
    # the wall over 0.15 whatever the load; the crowding adds to it by as much as the priorities allow (under
    # `nice -n 10 pytest` the busy process inherits nice 10 against the thread's 15: 0.39 s seen, not over 0.5)
    assert figures["wall_s"] > 0.15 and figures["cpu_s"] < 0.15, figures
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*fast-tier tests over the budget in wall seconds*", "*test_crowded.py::test_crowded"])


def test_the_budget_is_off_at_zero_and_the_report_counts_per_file_and_tier(pytester: pytest.Pytester) -> None:
    _with_timing(pytester)
    out = pytester.path / "timing.json"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--test-budget-s=0", "--timing-report",
                                          f"--timing-json={out}")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["test_budget.py*fast*3*", "test_budget.py*slow*1*"])
    tests = json.loads(out.read_text())
    assert tests["test_budget.py::test_computes"]["cpu_s"] >= 0.35
    assert tests["test_budget.py::test_waits"]["cpu_s"] < 0.2 <= tests["test_budget.py::test_waits"]["wall_s"]
    assert tests["test_budget.py::test_waits"]["load_per_core"] >= 0
    assert "over the budget in wall seconds" not in result.stdout.str()  # the list is off with the budget


def test_cpu_of_the_process_tree_counts_a_child_that_computes() -> None:
    before = timing.tree_cpu_s()
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert timing.tree_cpu_s() - before >= 0.45


def _middle(burn_s: float) -> subprocess.Popen[str]:
    """A child whose own child computes ``burn_s`` CPU seconds, says so, and sleeps."""
    grandchild = (f"import time\nend = time.process_time() + {burn_s}\nwhile time.process_time() < end:\n    pass\n"
                  "print('burnt', flush=True)\ntime.sleep(30)")
    return subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                                                   f"{grandchild!r}])"], stdout=subprocess.PIPE, text=True)


def _end(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        for descendant in psutil.Process(proc.pid).children(recursive=True):
            descendant.kill()
        proc.kill()
        proc.wait()


def test_cpu_of_the_process_tree_counts_a_live_grandchild_that_computes() -> None:
    """A descendant still running when the figure is read (a rank forked by a server the test started) counts
    with what it computed so far: it is found through its parent, not by its parent's counters. Children come
    before grandchildren."""
    before = timing.tree_cpu_s()
    middles = [_middle(0.5), _middle(0.0)]
    try:
        for middle in middles:
            assert middle.stdout is not None and middle.stdout.readline().strip() == "burnt"
        grandchildren = [psutil.Process(m.pid).children()[0].pid for m in middles]
        found = timing.live_descendants()  # (under pytest-xdist, the worker's fork server is one too)
        assert {m.pid for m in middles} | set(grandchildren) <= set(found)
        assert max(found.index(m.pid) for m in middles) < min(map(found.index, grandchildren))
        assert sorted(found) == sorted(p.pid for p in psutil.Process().children(recursive=True))
        assert timing.tree_cpu_s() - before >= 0.45
    finally:
        _end(*middles)


def test_a_child_started_by_another_thread_is_found_while_that_thread_runs() -> None:
    """The kernel lists a child under the thread that started it (a Popen in a helper thread, a rank started by
    a pool's thread): every thread's list is read, not the main thread's alone."""
    started: list[subprocess.Popen[str]] = []
    done = threading.Event()

    def start() -> None:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], text=True))
        done.wait(60)

    thread = threading.Thread(target=start)
    thread.start()
    try:
        while not started:
            time.sleep(0.01)
        assert started[0].pid in timing.live_descendants()
    finally:
        done.set()
        thread.join()
        _end(*started)


def test_without_the_kernels_children_lists_the_descendants_are_read_through_psutil(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built without ``CONFIG_PROC_CHILDREN`` has no children files: every descendant is still found."""
    real_open = open

    def no_children_file(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("/children"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    middle = _middle(0.0)
    try:
        assert middle.stdout is not None and middle.stdout.readline().strip() == "burnt"
        monkeypatch.setattr(timing, "open", no_children_file, raising=False)
        assert timing.children_of(os.getpid()) is None
        found = timing.live_descendants()
        assert middle.pid in found and psutil.Process(middle.pid).children()[0].pid in found
    finally:
        _end(middle)


@pytest.mark.parametrize(("argv", "cli"), [
    (["/venv/bin/python", "-m", "ddptrain", "train.steps=2"], True),
    (["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "-m", "ddptrain"], True),
    (["/venv/bin/ddptrain", "--help"], True),
    (["/venv/bin/python", "-c", "import ddptrain"], False),
    (["shellcheck", "scripts/multinode.sh"], False),
])
def test_a_run_of_the_command_is_told_from_other_processes(argv: list[str], cli: bool) -> None:
    assert timing.is_cli_run(argv) == cli


SHARED_FIXTURE = """
import os
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / f"setup-{os.getpid()}").write_text("")
    return 1

@pytest.mark.parametrize("i", range(6))
def test_uses_it(shared, i):
    assert shared == 1

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass

@pytest.mark.xdist_group("timing")
def test_timed():
    pass
"""


def test_tests_sharing_a_module_fixture_get_one_group_and_the_others_none(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_shared=SHARED_FIXTURE)
    items = pytester.getitems(pytester.path / "test_shared.py")
    groups = xdist_groups.assign_groups(items)
    shared = {groups[i.nodeid] for i in items if "uses_it" in i.nodeid}
    assert len(shared) == 1 and shared != {"timing"}
    assert not any("alone" in i.nodeid and i.nodeid in groups for i in items)
    assert [groups[i.nodeid] for i in items if "timed" in i.nodeid] == ["timing"]


def test_two_timing_groups_sharing_a_fixture_are_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_shared=SHARED_FIXTURE + """
@pytest.mark.xdist_group("other")
def test_other(shared):
    pass

@pytest.mark.xdist_group("timing")
def test_timed_too(shared):
    pass
""")
    with pytest.raises(pytest.UsageError, match=r"xdist groups \['other', 'timing'\] share a module fixture"):
        xdist_groups.assign_groups(pytester.getitems(pytester.path / "test_shared.py"))


def test_under_xdist_a_module_fixture_is_set_up_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the groups, ``--dist load`` spreads the six tests over both workers and each sets the fixture up."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest('pytest_plugins = ["tests.helpers.xdist_groups"]\n')
    pytester.makepyfile(test_shared=SHARED_FIXTURE)
    # the environment's other plugins (Hydra's, anyio's, platformdirs') have no part here: each of the three pytest
    # processes imported them, 3 of the test's 4.4 CPU s
    quiet = [arg for name in ("hydra_pytest", "anyio", "platformdirs") for arg in ("-p", f"no:{name}")]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *quiet, "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=13)
    setups = list(pytester.path.glob("**/setup-*"))
    assert len(setups) == 1, setups


@pytest.mark.parametrize(("workers", "cores", "threads"), [("2", 2, [1]), ("2", 8, [4]), ("3", 2, [1]), ("1", 2, [])])
def test_each_xdist_worker_computes_on_its_share_of_the_cores(
    workers: str, cores: int, threads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers on two cores with torch's thread per core each ran four spinning OpenMP threads on two cores;
    without xdist ("1") torch keeps its default."""
    import torch

    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    xdist_threads.take_a_share_of_the_cores()
    assert set_to == threads


def test_each_distinct_run_starts_once_for_every_worker_of_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[list[str]] = []

    def fake_run(args: list[str], cwd: Path, **_: object) -> subprocess.CompletedProcess[str]:
        started.append(args)
        (cwd / "run").mkdir()
        return subprocess.CompletedProcess(args, 0, "out", f"err {len(started)}")

    monkeypatch.setattr(run_cache, "run_cli", fake_run)
    gw0, gw1 = run_cache.RunCache(tmp_path), run_cache.RunCache(tmp_path)  # two workers, one shared root
    first = gw0.run(["train.steps=2", "hydra.run.dir=run"])
    again = gw1.run(["train.steps=2", "hydra.run.dir=run"])
    other = gw1.run(["train.steps=2", "hydra.run.dir=run"], torchrun_nproc=2)
    assert started == [["train.steps=2", "hydra.run.dir=run"]] * 2
    assert first == again and first.stderr == "err 1" and first.run_dir.is_dir()
    assert other.cwd != first.cwd and other.stderr == "err 2"


def test_the_shared_root_is_above_each_workers_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    assert run_cache.shared_root(tmp_path_factory, "gw1") == base.parent / "run-cache"
    assert run_cache.shared_root(tmp_path_factory, "master") == base / "run-cache"


def test_a_test_is_marked_with_the_packages_its_file_and_helpers_import(request: pytest.FixtureRequest) -> None:
    marks = {m.name for m in request.node.iter_markers()}
    assert {"app", "plan"} <= package_marks.file_packages(REPO / "tests" / "test_predict.py")  # through helpers.cli
    assert "plan_memory" in package_marks.file_packages(REPO / "tests" / "test_memory_trace.py")
    assert "data" not in marks  # this file imports no ddptrain package, only the suite's helpers


def test_the_package_marks_are_made_when_m_or_k_names_a_package_and_select_by_it(pytester: pytest.Pytester) -> None:
    """``-m data`` and ``-k data`` select the tests whose file imports ``ddptrain.data``; ``-m "not slow"`` selects by
    no package and marks nothing (the marks' read of every file's imports is skipped)."""
    pytester.makepyfile(test_uses_data="import ddptrain.data\n\ndef test_a():\n    pass\n",
                        test_uses_none="def test_b():\n    pass\n")
    plugin = ["-p", "tests.helpers.package_marks", "-p", "no:randomly", "-p", "no:cacheprovider"]
    for selection in (["-m", "data"], ["-m", "data and not slow"], ["-k", "data"]):
        pytester.runpytest_inprocess(*plugin, *selection).assert_outcomes(passed=1, deselected=1)
    marked: list[set[str]] = []

    class Record:
        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
            marked.extend({m.name for m in item.iter_markers()} for item in items)

    pytester.runpytest_inprocess(*plugin, "-m", "not slow", plugins=[Record()]).assert_outcomes(passed=2)
    assert marked == [set(), set()]
    marked.clear()
    pytester.runpytest_inprocess(*plugin, "-m", "data or not slow", plugins=[Record()]).assert_outcomes(passed=2)
    assert "data" in marked[0] and "data" not in marked[1]


def test_every_package_has_tests_and_the_development_guide_names_every_mark() -> None:
    tests = sorted((REPO / "tests").glob("test_*.py"))
    covered = set().union(*(package_marks.file_packages(t) for t in tests))
    assert sorted(set(package_marks.all_packages()) - covered) == []
    guide = (REPO / "docs" / "development.md").read_text()
    listed = set(re.findall(r"`-m (\w+)`", guide))
    assert sorted(set(package_marks.all_packages()) ^ listed) == []


def test_ci_runs_exactly_the_readmes_test_command_on_both_cores() -> None:
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "[test]" in line)
    assert command.endswith(".venv/bin/pytest -q -n 2 --dist loadgroup")
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


# a command that starts a child in a session of its own (as torchrun starts its workers), then hangs
HANGS_WITH_A_CHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]], start_new_session=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _nothing_left(marker: str) -> Iterator[None]:
    """After the block, no live process has ``marker`` on its command line (any left is killed, and fails)."""
    try:
        yield
        left = _named(marker)
        assert not left, f"left behind: {[' '.join(p.cmdline()) for p in left]}"
    finally:
        for proc in _named(marker):
            proc.kill()


def _named(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_a_cli_run_that_times_out_leaves_no_process_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung run killed at its timeout takes its whole tree with it: the workers torchrun starts in sessions of
    their own were left running, adopted by init, when only the launcher was killed."""
    from tests.helpers import cli

    marker, started = f"orphan-probe-{uuid.uuid4().hex}", tmp_path / "child-started"
    hangs = HANGS_WITH_A_CHILD.replace("time.sleep(60)\n", f"open({str(started)!r}, 'w').close()\ntime.sleep(60)\n")
    monkeypatch.setattr(cli, "cli_command", lambda args, torchrun_nproc=None: [sys.executable, "-c", hangs, marker])
    timeout = 0.5  # a run is killed that had started its child: on a busy machine that may take longer
    while not started.exists() and timeout < 60:
        with _nothing_left(marker), pytest.raises(subprocess.TimeoutExpired):
            cli.run_cli([], cwd=tmp_path, cache=tmp_path / "cache", timeout=timeout)
        timeout *= 2
    assert started.exists()


STARTS_A_RUN_AND_FAILS = """
import sys
import time

import psutil

from tests.helpers import procs


def test_fails_while_its_run_is_live():
    procs.start([sys.executable, "-c", {script!r}, {marker!r}])
    while len([p for p in psutil.process_iter(["cmdline"]) if {marker!r} in (p.info["cmdline"] or [])]) < 2:
        time.sleep(0.05)  # the command, and the child it started in a session of its own
    assert False, "the run was live"
"""


def test_a_test_that_fails_while_its_run_is_live_leaves_no_process_behind(pytester: pytest.Pytester) -> None:
    _runs_leaving_nothing(pytester, STARTS_A_RUN_AND_FAILS, "orphan-probe", failed=1)


def _runs_leaving_nothing(pytester: pytest.Pytester, source: str, name: str, **outcomes: int) -> None:
    """Run ``source`` (a test file whose runs carry a marker on their command line) under the procs plugin, check
    its outcomes and that no process of its runs is left."""
    marker = f"{name}-{uuid.uuid4().hex}"
    pytester.makeconftest('pytest_plugins = ["tests.helpers.procs"]\n')
    pytester.makepyfile(**{f"test_{name.replace('-', '_')}": source.format(script=HANGS_WITH_A_CHILD, marker=marker)})
    with _nothing_left(marker):
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(**outcomes)


STARTS_A_RUN_FOR_THE_MODULE = """
import sys
import time

import psutil
import pytest

from tests.helpers import procs

MARKER = {marker!r}


def _live():
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if MARKER in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def run():
    proc = procs.start([sys.executable, "-c", {script!r}, MARKER], ends_with_test=False)
    while len(_live()) < 2:
        time.sleep(0.05)
    yield proc
    procs.kill_tree(proc)


def test_first(run):
    assert run.poll() is None


def test_second_sees_the_run_the_first_test_started(run):
    assert run.poll() is None and len(_live()) == 2
"""


def test_a_run_a_module_fixture_started_lives_until_the_fixtures_teardown_then_leaves_nothing(
    pytester: pytest.Pytester,
) -> None:
    """The hang cases' runs (``tests/helpers/staggered.py``) are started by a module fixture and outlive the first
    test: the end-of-test cleanup must not kill them (it did: 6 of 12 hang cases failed with -9), the fixture's
    teardown must."""
    _runs_leaving_nothing(pytester, STARTS_A_RUN_FOR_THE_MODULE, "module-run-probe", passed=2)


@pytest.mark.slow
def test_the_forked_ranks_preload_holds_the_trainer_and_what_it_imports() -> None:
    """Forked ranks start from the forkserver's preloaded modules; when ``ddptrain.train`` became a light package,
    preloading it stopped preloading the trainer and every rank imported it again (the fast tier's CPU doubled)."""
    from tests.helpers.dist import PRELOAD

    probe = f"import sys\nfor m in {PRELOAD!r}: __import__(m)\nprint('ddptrain.train.trainer' in sys.modules, " \
            "'ddptrain.plan.memory.trace' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.split() == ["True", "True"], done.stdout


def test_the_seconds_table_renews_the_files_a_run_measured_and_keeps_the_others() -> None:
    """``bench_tests.py --seconds F --keep``: a run of some files replaces their tests' and tiers' figures (a test
    gone from them too) and leaves every other file's."""
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "bench_tests.py"
    spec = importlib.util.spec_from_file_location("bench_tests", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    old = {"tests": {"tests/a.py::t1": 9.0, "tests/a.py::gone": 5.0, "tests/b.py::t": 7.0},
           "files": {"tests/a.py::slow": 4.0, "tests/b.py::slow": 3.0}}
    new = {"tests": {"tests/a.py::t1": 2.5, "tests/c.py::t": 30.0},
           "files": {"tests/a.py::slow": 1.5, "tests/a.py::fast": 0.2, "tests/c.py::slow": 30.0}}
    merged = bench.merged_table(old, new, {"tests/a.py", "tests/c.py"})
    assert merged == {"tests": {"tests/a.py::t1": 2.5, "tests/b.py::t": 7.0, "tests/c.py::t": 30.0},
                      "files": {"tests/a.py::fast": 0.2, "tests/a.py::slow": 1.5, "tests/b.py::slow": 3.0,
                                "tests/c.py::slow": 30.0}}


IMPORTED_WITH_THE_COLLECTOR_ON = gc.isenabled()  # this module's import, in the collection


def test_a_test_runs_with_the_collector_on_and_the_collected_objects_frozen() -> None:
    """conftest.py turns Python's cyclic collector off while the test modules import; every test runs with it on
    again, less often, and with what collection made frozen (never walked again)."""
    assert not IMPORTED_WITH_THE_COLLECTOR_ON
    assert gc.isenabled() and gc.get_threshold() == collector.THRESHOLDS
    assert gc.get_freeze_count() > 100_000


def test_settling_frees_the_cycles_made_while_the_collector_was_off_before_it_freezes() -> None:
    class Node:
        pass

    was = gc.isenabled()
    gc.disable()
    try:
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        ref = weakref.ref(cycle)
        del cycle
        collector.settle()
        assert ref() is None and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_the_frozen_objects_are_walked_again_at_the_end() -> None:
    """``pytest_unconfigure`` unfreezes them, so that the interpreter's last collection frees what they hold."""
    import tests.conftest as conftest

    frozen = gc.get_freeze_count()
    try:
        conftest.pytest_unconfigure(pytest.Config.__new__(pytest.Config))
        assert frozen > 0 and gc.get_freeze_count() == 0
    finally:
        gc.freeze()


def _collector_state(rank: int, world_size: int) -> tuple[bool, tuple[int, int, int], int, int]:
    return gc.isenabled(), gc.get_threshold(), gc.get_freeze_count(), gc.get_stats()[2]["collections"]


def test_a_forked_rank_starts_with_the_servers_modules_frozen_and_the_collector_on() -> None:
    """The server preloaded with the collector off (one full collection since: the one before the freeze)."""
    (enabled, thresholds, frozen, full_collections), = run_distributed(_collector_state, 1)
    assert enabled and thresholds == collector.THRESHOLDS and frozen > 100_000 and full_collections <= 2


ENDS = """
import atexit, os


class TornDown:
    def __init__(self):
        self.line = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} torn down\\n"
        self.path = os.environ["MARKS"]

    def __del__(self, open=open):  # the builtins may be gone by then
        with open(self.path, "a") as marks:
            marks.write(self.line)


KEPT = TornDown()  # freed by the interpreter's teardown of this module, if it has one


def test_registers_a_librarys_exit_handler():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    atexit.register(lambda: open(os.environ["MARKS"], "a").write(f"{worker} exit handler ran\\n"))


def test_fails():
    assert False, "a failure stays a failure"
"""


@pytest.mark.slow  # three pytest processes, each loading the suite's plugins
@pytest.mark.parametrize("workers", ["2", "0"])
def test_an_xdist_worker_ends_after_every_exit_handler_without_the_teardown_and_a_failure_still_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: str
) -> None:
    """conftest.py's ``_end_a_worker``: under xdist each worker runs the exit handlers its tests' libraries
    registered and ends without the interpreter's teardown (nothing of it is freed); the run's verdict is the
    reports' (a failure fails it). Without xdist the process tears down as Python does."""
    marks = pytester.path / "marks.txt"
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):  # this test's own
        monkeypatch.delenv(name, raising=False)  # worker's, when the suite runs under xdist
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("MARKS", str(marks))
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(test_ends=ENDS)
    quiet = [arg for name in ("hydra_pytest", "anyio", "platformdirs") for arg in ("-p", f"no:{name}")]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *quiet, "-n", workers)
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == 1
    lines = marks.read_text().splitlines()
    assert any(line.endswith(" exit handler ran") for line in lines), lines
    torn_down = [line for line in lines if line.endswith(" torn down")]
    assert torn_down == ([] if workers == "2" else ["main torn down"]), lines
