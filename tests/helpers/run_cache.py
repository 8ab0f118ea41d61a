"""Each distinct CLI run once per test session: tests that check different things of one run share it.

A run is keyed by its command line (the overrides, torchrun's process count, extra environment). The first test
that asks runs it through ``tests/helpers/cli.py``'s ``run_cli`` in a directory of its own, and records its exit
code and output beside it; every later ask, on any pytest-xdist worker, gets that record and directory. The
directory is shared: a test that changes files in it copies it first (``shutil.copytree``). A file lock per key
makes a second worker that asks for a run in progress wait for it rather than start it again.

Cached runs give ``hydra.run.dir`` relative to their directory (``hydra.run.dir=run``, or none: Hydra's
``outputs/<date>/<time>``) and share one data cache, prepared once for all of them (``data.cache_dir`` entries
have their own locks across jobs, as in production).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers.cli import run_cli


@dataclass(frozen=True)
class Ran:
    """A finished CLI run: where it ran (its working directory), how it ended and what it printed."""

    cwd: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def run_dir(self) -> Path:
        """``hydra.run.dir=run``'s directory."""
        return self.cwd / "run"


class RunCache:
    """The runs of one test session, kept under ``root`` (shared by every xdist worker of the session)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_cache = root / "data-cache"
        self.data_cache.mkdir(parents=True, exist_ok=True)

    def run(self, args: Sequence[str], torchrun_nproc: int | None = None, extra_env: dict[str, str] | None = None,
            timeout: float = 300) -> Ran:
        """The run of ``ddptrain <args>`` (under torchrun with ``torchrun_nproc``), started now if no test of this
        session has started it yet."""
        key = json.dumps({"args": list(args), "torchrun_nproc": torchrun_nproc,
                          "env": sorted((extra_env or {}).items())})
        entry = self.root / hashlib.sha256(key.encode()).hexdigest()[:16]
        record = entry / "ran.json"
        with FileLock(str(entry) + ".lock"):
            if not record.is_file():
                cwd = entry / "cwd"
                cwd.mkdir(parents=True, exist_ok=True)
                done = run_cli(list(args), cwd=cwd, cache=self.data_cache, timeout=timeout, extra_env=extra_env,
                               torchrun_nproc=torchrun_nproc)
                record.write_text(json.dumps({"key": key, "returncode": done.returncode, "stdout": done.stdout,
                                              "stderr": done.stderr}))
        saved = json.loads(record.read_text())
        return Ran(entry / "cwd", saved["returncode"], saved["stdout"], saved["stderr"])


def shared_root(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A directory every worker of this session sees: the parent of the workers' own temporary roots under xdist
    (``.../pytest-N/popen-gw0`` -> ``.../pytest-N``), the session's own root without it."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if worker_id != "master" else base) / "run-cache"
