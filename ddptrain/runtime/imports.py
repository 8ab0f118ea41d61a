"""Start-up imports without Python's cyclic garbage collector.

A worker imports torch, transformers' modeling code and the training loop before its first step: millions of
objects (modules, classes, functions) that live as long as the process does. While they are created the collector
runs every few hundred allocations and its older generations walk all of them, again and again, to free nothing:
0.6 of a worker's 3.6 CPU s of imports on this project's machines, 0.2 of the launcher's 1.3 (``python -c`` timing
the same imports with the collector on and off, docs/benchmarks.md). Every worker of every launch pays it, and a
restart pays it again.

Only imports run under it. The model's own class (``transformers.models.<type>.modeling_<type>``, which one depends
on the checkpoint) is imported when the model is built, with the collector on. Reference counting still frees what
the imports drop; the collector comes back on when the block ends (as it was: a caller that turned it off keeps it
off), before the model, the data or the training loop make anything, so garbage in cycles is collected as before.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_the_collector() -> Iterator[None]:
    """The block's imports with the cyclic collector off; as it was after, whatever the block raised."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
