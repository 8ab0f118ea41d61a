"""One writer per entry of ``data.cache_dir``: an inter-process lock, and the clean-up of a killed writer's files.

The cache is shared by every job of a user (a sweep's jobs start together; nodes may share the storage). Each
entry (a tokenizer directory, a token-shard directory) has a lock file beside it; the job holding the lock
builds the entry under names unique to it, the others wait and then reuse what it built.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from ddptrain.errors import ConfigError

WAIT_LINE_EVERY_S = 10.0
log = logging.getLogger(__name__)


@contextmanager
def cache_lock(entry: Path, timeout_s: float) -> Iterator[None]:
    """Hold the lock of one cache entry. While another job holds it, wait (at most ``timeout_s``) and repeat that
    job's progress line every ``WAIT_LINE_EVERY_S``."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir={entry.parent}: cannot create it ({exc.strerror})") from exc
    lock = FileLock(f"{entry}.lock")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            lock.acquire(timeout=min(WAIT_LINE_EVERY_S, max(0.0, deadline - time.monotonic())))
            break
        except Timeout:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"data.prepare_timeout_s={timeout_s:g}: waited that long for another job preparing {entry} "
                    f"(it holds {entry}.lock); raise it, or let that job finish first"
                ) from None
            log.info("another job is preparing %s: %s", entry.name, read_progress(entry))
    try:
        yield
    finally:
        lock.release()


def progress_path(entry: Path) -> Path:
    return Path(f"{entry}.progress")


def read_progress(entry: Path) -> str:
    try:
        return progress_path(entry).read_text().strip() or "starting"
    except OSError:
        return "starting"


def unique_tmp(entry: Path, tag: str) -> Path:
    """A temporary name beside ``entry`` that no other writer uses."""
    return entry.with_name(f"{entry.name}.tmp-{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale(entry: Path) -> None:
    """Remove what a killed writer of ``entry`` left: temporaries beside it and unfinished files inside it.
    Call with the entry's lock held (then no live writer owns them)."""
    for stale in entry.parent.glob(f"{entry.name}.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    if entry.is_dir():
        for stale in entry.glob(".*.tmp"):
            stale.unlink(missing_ok=True)
