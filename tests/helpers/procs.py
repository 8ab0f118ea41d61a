"""Processes a test starts, and every process they start in turn, ended with the test: none outlives it.

A run of the command is a tree: the launcher, torchrun's agent, its workers (each in a session of its own, so a
signal to the launcher's group does not reach them), Ray's daemons and workers. ``subprocess.run(..., timeout=)``
kills only the process it started: when a hung run timed out, its workers were left running, adopted by init,
for hours. Here each command starts in a session of its own and carries a mark in its environment
(``TREE_MARK``, inherited by everything it starts, torchrun's workers and Ray's processes included); ending it
kills its descendants and every process that carries its mark, so a worker whose parent already died is found too.

- ``run``: ``subprocess.run``'s contract; on a timeout, or any exception while it waits (a failing test, Ctrl-C),
  the whole tree is killed before the exception goes on.
- ``start``: ``subprocess.Popen`` for tests that talk to a live run; what ``start`` started and is still alive
  when the test ends (passed or failed) is killed by the ``no_process_left_behind`` fixture (this module is a
  pytest plugin, loaded by ``tests/conftest.py``: the fixture is every test's).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psutil
import pytest

TREE_MARK = "DDPTRAIN_TEST_TREE"  # the environment variable every process of one started command carries
_STARTED: list[subprocess.Popen[Any]] = []  # what start() started during the running test


def _marked(env: Mapping[str, str] | None) -> tuple[dict[str, str], str]:
    mark = uuid.uuid4().hex
    return {**(os.environ if env is None else env), TREE_MARK: mark}, mark


def start(argv: Sequence[str | os.PathLike[str]], env: Mapping[str, str] | None = None,
          ends_with_test: bool = True, **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, env=env, ...)`` in a session of its own, its tree marked; killed at the test's end
    if still running, unless ``ends_with_test=False``: a run a module fixture started for several tests, which
    the fixture ends itself (``kill_tree``) at its teardown."""
    marked, mark = _marked(env)
    proc = subprocess.Popen(argv, env=marked, start_new_session=True, **popen)
    proc.tree_mark = mark  # type: ignore[attr-defined]
    if ends_with_test:
        _STARTED.append(proc)
    return proc


def run(argv: Sequence[str | os.PathLike[str]], timeout: float | None = None, env: Mapping[str, str] | None = None,
        input: str | bytes | None = None, **popen: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, timeout=timeout, env=env, ...)`` (``capture_output``, ``text``, ``check``, ``stdin``
    as there), the whole tree killed on a timeout or any exception while it runs."""
    check = popen.pop("check", False)
    if popen.pop("capture_output", False):
        popen["stdout"], popen["stderr"] = subprocess.PIPE, subprocess.PIPE
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    proc = start(argv, env=env, **popen)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    finally:
        _STARTED.remove(proc)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def tree_of(proc: subprocess.Popen[Any]) -> list[psutil.Process]:
    """``proc`` (while it lives), its descendants, and every process that carries its mark (a descendant whose
    parent died is no longer one; its mark stays)."""
    found: dict[int, psutil.Process] = {}
    if proc.poll() is None:  # not reaped yet, so its pid is still its own (a reaped one's may be reused)
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            found.update({p.pid: p for p in (root, *root.children(recursive=True))})
    mark = getattr(proc, "tree_mark", None)
    if mark is not None:
        for p in psutil.process_iter():
            try:
                if p.pid not in found and p.environ().get(TREE_MARK) == mark:
                    found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    return list(found.values())


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s whole tree (``tree_of``) and wait until every one of them is dead, ``proc`` reaped."""
    for _ in range(3):  # a process forking while we kill: look again
        family = tree_of(proc)
        if not family:
            break
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        _wait_dead([p for p in family if p.pid != proc.pid], timeout=10)
    proc.wait(timeout=10)  # SIGKILL needs no consent: it is gone
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _wait_dead(family: list[psutil.Process], timeout: float) -> None:
    """Until each of ``family`` is gone or a zombie. A dead descendant whose parent died too stays a zombie until
    init reaps it, which this machine's init does about a second later (``psutil.wait_procs`` waited for that)."""
    deadline = time.monotonic() + timeout
    while family and time.monotonic() < deadline:
        family = [p for p in family if _alive(p)]
        if family:
            time.sleep(0.005)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_all(started: list[subprocess.Popen[Any]]) -> list[str]:
    """Empty ``started``, killing each process still running (with its tree); their command lines."""
    left = []
    while started:
        proc = started.pop()
        if proc.poll() is None or tree_of(proc):
            left.append(" ".join(map(str, proc.args)))  # type: ignore[arg-type]
            kill_tree(proc)
    return left


def end_started() -> list[str]:
    """Kill what ``start`` started during the test and is still running (with its tree); their command lines."""
    return end_all(_STARTED)


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """After every test, passed or failed: what ``start`` started and is still running is killed, with its tree."""
    yield
    end_started()
