"""A pytest plugin: each test's wall-clock and CPU seconds, a per-file and per-tier report, and the fast tier's budget.

CPU is counted over the test's whole process tree: the pytest process itself, every process it started and has
reaped (``RUSAGE_CHILDREN``), and every live descendant with what it has reaped in turn (the forkserver of
``tests/helpers/dist.py`` reaps the forked ranks, so their CPU lands in its counters). Summed before and after a
test, the difference is what the test's processes computed, whichever of them did it; a rank that outlives its
parent and is adopted by init is the one thing lost. CPU seconds hardly move with the machine's load, wall seconds
do: a test whose wall time is far above its CPU time waits (timeouts, sleeps, polls) instead of computing.

The budget (``--test-budget-s``, default ``DEFAULT_BUDGET_S``) holds every fast-tier test (not marked ``slow``),
setup and call together (a module fixture's work is charged to the test that first asks for it, as pytest's
``--durations`` does): its CPU seconds may not exceed it. Work does not depend on what else runs on the machine, so
the verdict does not either. Wall seconds are measured and reported, never judged: how long a test waited for a
core is the machine's doing, and the load average cannot say what share of the cores one test got (load 6 on 2
cores gave one test 133 wall s for 6.5 CPU s, another its full share). A fast-tier test whose wall time is over the
budget is listed at the end of the run with its CPU seconds and the load per core when it ran: one that waits
(timeouts, sleeps, polls) shows there with little CPU on a quiet machine, and is made to wait less or moved to the
slow tier by hand.

Each test's record also counts the processes its pytest process started (``subprocess`` calls, seen through
Python's audit hook) and, among them, the runs of the command (``ddptrain``, directly or under torchrun): the
start-ups a CLI-level check pays for. It also names the pytest-xdist worker that ran the test and the clock times
(seconds since the epoch) it started and ended: the workers' timelines, where a run's tail shows.

A test over the CPU budget fails with both figures. ``--test-budget-s=0`` turns the check off (and the list).
``--timing-report`` prints the per-file and per-tier table at the end; ``--timing-json=PATH`` writes every test's
figures, wall seconds and the load per core among them (what ``scripts/bench_tests.py`` reads).
Both work under pytest-xdist: the figures travel with the test reports.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

DEFAULT_BUDGET_S = 20.0
_START = pytest.StashKey[tuple[float, float, int, float]]()
_STARTED: list[list[str]] = []  # every command line this process has started, in order


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = args[1]
        _STARTED.append([str(a) for a in argv] if isinstance(argv, (list, tuple)) else [str(argv)])


def is_cli_run(argv: list[str]) -> bool:
    """A run of the command: ``python -m ddptrain``, under ``torch.distributed.run``, or the console script."""
    modules = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"}
    return "ddptrain" in modules or "tests.helpers.flash_attn_cli" in modules or Path(argv[0]).name == "ddptrain"


def children_of(pid: int) -> list[int] | None:
    """The live children of ``pid``, from the kernel's per-thread list (``/proc/PID/task/TID/children``); None where
    the kernel keeps no such list. Read three times per test: psutil's ``children()`` finds them by reading the
    parent of every process on the machine, 1-2 ms a call (about 5 of every 1,000 tests' CPU seconds), this 0.07."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # exited: nothing of it left to count
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as listing:
                found.extend(int(child) for child in listing.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):  # the thread ended between the listing and the read
                continue
            return None  # a kernel built without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return found


def live_descendants() -> list[int]:
    """This process's live descendants, children first."""
    todo = children_of(os.getpid())
    if todo is None:
        return [child.pid for child in psutil.Process().children(recursive=True)]
    seen: list[int] = []
    while todo:
        pid = todo.pop(0)
        seen.append(pid)
        todo.extend(children_of(pid) or [])
    return seen


def tree_cpu_s() -> float:
    """CPU seconds (user + system) this process, its reaped children and its live descendants (with theirs) used."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for pid in live_descendants():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:  # exited between the listing and the read: its parent's counters hold it now
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def load_per_core() -> float:
    """Runnable processes per core over the last minute: reported beside a test's wall seconds (how crowded the
    machine was), never used to judge it."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def plain_nodeid(item: pytest.Item) -> str:
    """The test's id without the ``@group`` pytest-xdist's loadgroup appends to it."""
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    return item.nodeid.removesuffix("@" + "_".join(groups)) if groups else item.nodeid


def tier(item: pytest.Item) -> str:
    return "slow" if item.get_closest_marker("slow") is not None else "fast"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddptrain timing")
    group.addoption("--test-budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"a fast-tier test fails over this many CPU seconds (its process tree's); its wall seconds "
                         f"over it are reported, not failed (default {DEFAULT_BUDGET_S:g}; 0: off)")
    group.addoption("--timing-report", action="store_true", help="print wall and CPU seconds per file and per tier")
    group.addoption("--timing-json", default=None, help="write each test's wall and CPU seconds to this file")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START] = (time.perf_counter(), tree_cpu_s(), len(_STARTED), time.time())


def _since_start(item: pytest.Item) -> tuple[float, float]:
    wall0, cpu0, _, _ = item.stash[_START]
    return time.perf_counter() - wall0, tree_cpu_s() - cpu0


def _started_since(item: pytest.Item) -> list[list[str]]:
    return _STARTED[item.stash[_START][2]:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if _START not in item.stash:
        return report
    if call.when == "call":
        wall, cpu = _since_start(item)
        budget = item.config.getoption("test_budget_s")
        # CPU only: wall seconds depend on the machine's load, which no test controls (they are reported instead)
        if budget and tier(item) == "fast" and report.passed and cpu > budget:
            report.outcome = "failed"
            report.longrepr = (f"over the fast tier's budget: {cpu:.1f} CPU s (budget {budget:g}; {wall:.1f} wall s "
                               f"at {load_per_core():.1f} runnable per core): make it cheaper, or move it to the "
                               f"slow tier")
    elif call.when == "teardown":
        wall, cpu = _since_start(item)
        started = _started_since(item)
        record = {"test": plain_nodeid(item), "tier": tier(item), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                  "processes": len(started), "cli_runs": sum(map(is_cli_run, started)),
                  "load_per_core": round(load_per_core(), 2),
                  # where and when it ran: the workers' timelines (which one ended last, and on what)
                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "master"),
                  "start": round(item.stash[_START][3], 3), "end": round(time.time(), 3)}
        report.user_properties.append(("timing", record))
    return report


@dataclass
class Timings:
    """What the controller heard: each test's figures, from its teardown report."""

    tests: dict[str, dict[str, float | str]]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == "timing":
                self.tests[str(value["test"])] = value

    def over_wall(self, budget: float) -> list[tuple[str, dict[str, float | str]]]:
        """The fast-tier tests whose wall seconds passed the budget, longest first: waits on a quiet machine (little
        CPU, load per core under 1), the machine's queue on a busy one."""
        if not budget:
            return []
        over = [(n, t) for n, t in self.tests.items() if t["tier"] == "fast" and float(t["wall_s"]) > budget]
        return sorted(over, key=lambda kv: -float(kv[1]["wall_s"]))

    def per_file(self) -> dict[tuple[str, str], list[float]]:
        """(file, tier) -> [tests, wall s, CPU s, processes started, CLI runs]."""
        rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
        for nodeid, t in self.tests.items():
            row = rows[(nodeid.split("::")[0], str(t["tier"]))]
            for i, value in enumerate((1, t["wall_s"], t["cpu_s"], t["processes"], t["cli_runs"])):
                row[i] += float(value)
        return rows

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        if path := config.getoption("timing_json"):
            Path(path).write_text(json.dumps(self.tests, indent=1, sort_keys=True))
        write = terminalreporter.write_line
        if waited := self.over_wall(config.getoption("test_budget_s")):
            terminalreporter.section("fast-tier tests over the budget in wall seconds (reported, not failed)")
            write(f"{'wall s':>8} {'CPU s':>8} {'load/core':>9}  test")
            for nodeid, t in waited:
                figures = (float(t["wall_s"]), float(t["cpu_s"]), float(t["load_per_core"]))
                write(f"{figures[0]:>8.1f} {figures[1]:>8.1f} {figures[2]:>9.1f}  {nodeid}")
        if not config.getoption("timing_report"):
            return
        rows = self.per_file()
        terminalreporter.section("time per file and tier (wall and CPU seconds of each test's process tree)")
        write(f"{'file':<45} {'tier':<5} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'procs':>6} {'CLI':>5}")
        for (file, tier_name), row in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            write(f"{file:<45} {tier_name:<5} " + _cells(row))
        for tier_name in ("fast", "slow"):
            mine = [r for (_, t), r in rows.items() if t == tier_name]
            if mine:
                write(f"{'all':<45} {tier_name:<5} " + _cells([sum(r[i] for r in mine) for i in range(5)]))


def _cells(row: list[float]) -> str:
    n, wall, cpu, procs, cli = row
    return f"{n:>5.0f} {wall:>8.1f} {cpu:>8.1f} {procs:>6.0f} {cli:>5.0f}"


_AUDITING: list[bool] = []  # an audit hook cannot be removed: one per process, even when pytest runs in pytest


def pytest_configure(config: pytest.Config) -> None:
    if not _AUDITING:
        sys.addaudithook(_audit)
        _AUDITING.append(True)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) gathers the figures
        config.pluginmanager.register(Timings({}), "ddptrain-timings")
