"""What a launch's own processes wrote: a file in the run dir counts as this launch's when it was last written at
or after the launch started. A run continued in its run dir (``train.resume=auto``) finds its earlier launches'
files there (hang evidence, group summaries), which say nothing about this one; a sweep dir used again holds the
earlier sweep's job results (``app/sweep_job.py``), read by the same rule from the sweep's start."""

from __future__ import annotations

from pathlib import Path


def written_since(path: Path, since: float) -> bool:
    """Whether ``path`` exists and was last written at or after ``since`` (``time.time()``)."""
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False
