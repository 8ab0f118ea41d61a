"""Run a function in N gloo processes and collect what each rank returns (for multi-process tests).

Ranks start from a fork server that has imported torch, transformers, datasets and the training loop once per
test session: a spawned rank pays that import (several seconds of CPU) on every call, a forked one does not. The
server only imports: it builds no process group and computes nothing (so no OpenMP pool exists that a fork
could break), and each rank starts from a fresh copy of that state, as a spawned one would. One difference: a
rank prints where the server prints (the output captured for the test that started it), not into the calling
test's captured output; a failing rank's traceback still comes back with the call and fails it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# What the server imports before it forks a rank: the ranks' libraries, with the garbage collector off, then frozen
# (tests/helpers/rank_server.py says which and why)
PRELOAD = ["tests.helpers.rank_server"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, results: Any, args: tuple,
            environ: dict[str, str]) -> None:
    # The server's environment is the one it started with: each rank takes the caller's, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the traceback travels to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))


def _started() -> None:
    """What ``warm_forkserver``'s process runs: nothing."""


def warm_forkserver() -> None:
    """Start the fork server and wait until it has imported ``PRELOAD`` (seconds of CPU, more on a busy machine).

    Called once per pytest process before its first test (``tests/conftest.py``): otherwise the import is paid
    inside whichever test first calls ``run_distributed``, which the fast tier's CPU budget charges with it and whose
    rank timeout it eats into; that test depends on the order the tests ran in, not on what it does.
    """
    # The server and every rank it forks print to the descriptors it started with. Started inside a test, those were
    # that test's capture file; started here, before any test, they would be the terminal: the ranks' lines (a
    # failing rank's traceback comes back through run_distributed) go nowhere instead.
    sys.stdout.flush()
    sys.stderr.flush()
    kept = [os.dup(fd) for fd in (1, 2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        process = _CTX.Process(target=_started, daemon=True)
        process.start()  # the server starts here; the process is answered once it has preloaded
    finally:
        for fd, copy in zip((1, 2), kept, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
    process.join()


def _to_bytes(value: Any) -> bytes:
    """Results travel as bytes: tensors sent through a queue are shared-memory handles that die with the child."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; return results by rank.

    ``fn`` must be a module-level function (it is pickled into the ranks) and its result picklable.
    A rank that raises fails the call with that rank's traceback; a rank that hangs fails it after ``timeout``.
    """
    results = _CTX.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            _CTX.Process(target=_worker, args=(fn, r, world_size, store, results, args, environ), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, ok, value = results.get(timeout=timeout)
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break
        except queue.Empty:
            errors.append(f"timed out after {timeout}s; ranks that answered: {sorted(out)}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
