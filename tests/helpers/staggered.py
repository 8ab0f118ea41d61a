"""Run several real CLI jobs whose start-ups take turns and whose waits overlap.

A hang test's job spends its first seconds importing (CPU-bound) and its last ones waiting on a collective
timeout and a stop grace (idle). The jobs run in ``lanes`` (1 or more sequences side by side); in a lane each job
starts when the one before it has printed ``ready`` (or ended), so one job's imports run while the one before it
waits. Each job's time is its own, from its start to its exit (and from its ``ready`` to its exit), and the
processes it leaves behind are listed the moment it exits.
"""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.helpers import procs
from tests.helpers.cli import cli_command, test_env


@dataclass(frozen=True)
class Job:
    """One ``ddptrain`` run: its arguments, where it runs (``cwd``, whose path every one of its processes is
    given on its command line), its data cache and extra environment."""

    args: list[str]
    cwd: Path
    cache: Path
    extra_env: dict[str, str]


@dataclass(frozen=True)
class Finished:
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    elapsed: float  # seconds from the job's start to its exit
    ready_s: float | None  # seconds from the job's start to its ``ready`` line (None: it never printed one)
    survivors: list[str]  # command lines naming the job's cwd, read as soon as it exited


def survivors(marker: str) -> list[str]:
    """Command lines of the processes that name ``marker`` (a job's run dir, which each of its workers is given)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in part for part in cmdline):
            found.append(" ".join(cmdline))
    return found


def run_staggered(jobs: dict[str, Job], ready: str, timeout: float, lanes: int = 1) -> dict[str, Future[Finished]]:
    """Start ``jobs`` in ``lanes`` sequences (job i in lane i mod ``lanes``), in each one job once the one before
    it printed ``ready`` on stderr or ended; return at once, with a future per job. A job that runs longer than
    ``timeout`` s is killed (its whole tree: ``tests/helpers/procs.py``) and its future fails."""
    futures: dict[str, Future[Finished]] = {name: Future() for name in jobs}
    names = list(jobs)

    def start_lane(lane: list[str]) -> None:
        for name in lane:
            job = jobs[name]
            try:
                proc, stdout, stderr = _start(job)
            except BaseException as exc:  # noqa: BLE001 - the test waiting on this job reports it
                futures[name].set_exception(exc)
                continue
            started = time.monotonic()
            seen = _Ready()
            threading.Thread(target=_finish, args=(proc, job, stdout, stderr, started, timeout, seen, futures[name]),
                             daemon=True).start()
            while proc.poll() is None and ready not in stderr.read_text(errors="replace"):
                if time.monotonic() - started > timeout:
                    break
                time.sleep(0.2)
            if ready in stderr.read_text(errors="replace"):
                seen.at = time.monotonic() - started
            seen.known.set()

    for lane in range(lanes):
        threading.Thread(target=start_lane, args=(names[lane::lanes],), daemon=True, name="staggered_jobs").start()
    return futures


@dataclass
class _Ready:
    """When a job printed its ``ready`` line (seconds from its start), once its lane knows."""

    at: float | None = None
    known: threading.Event = field(default_factory=threading.Event)


def _start(job: Job) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = job.cwd.with_name(f"{job.cwd.name}.stdout"), job.cwd.with_name(f"{job.cwd.name}.stderr")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        # the jobs outlive the test that started them (a module fixture's, each case's test waits for its own):
        # ended by ``end_unfinished`` at the fixture's teardown, not at the end of whichever test was running
        proc = procs.start(cli_command(job.args), cwd=job.cwd, env=test_env(job.cache, job.extra_env),
                           ends_with_test=False, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    _LIVE.append(proc)
    return proc, out, err


_LIVE: list[subprocess.Popen[bytes]] = []  # every job started, for end_unfinished


def end_unfinished() -> list[str]:
    """Kill every job still running (with its whole tree); their command lines. For the fixture's teardown."""
    return procs.end_all(_LIVE)


def _finish(proc: subprocess.Popen[bytes], job: Job, stdout: Path, stderr: Path, started: float, timeout: float,
            seen: _Ready, future: Future[Finished]) -> None:
    try:
        returncode = proc.wait(timeout=max(0.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        procs.kill_tree(proc)  # its workers too, not the launcher alone
        future.set_exception(exc)
        return
    elapsed = time.monotonic() - started
    left = survivors(str(job.cwd))
    seen.known.wait(5)  # the lane reads the job's last output at once after its exit
    future.set_result(Finished(job.cwd, returncode, stdout.read_text(errors="replace"),
                               stderr.read_text(errors="replace"), elapsed, seen.at, left))
