"""Python's cyclic garbage collector in the suite's processes (pytest's, and the rank fork server's).

A test process holds millions of objects from its imports (torch, transformers, the collected tests) that live to
its end, and the collector's older generations walk all of them, again and again, to free nothing. So:

- the imports run with it off (``tests/conftest.py`` while the test modules import; ``tests/helpers/rank_server.py``
  while the fork server preloads): collecting the fast tier took 9.1 CPU s a worker with it on, 8.0 off;
- then ``settle``: what exists is frozen (never walked again; a forked rank shares those pages with its server
  instead of copying them as the collector marks them) and the collector runs less often. In the fast tests of four
  modules (318 tests, 68 CPU s), it took 4.3 CPU s as Python sets it and 2.3 so.

Reference counting frees what it always did; cycles are collected as before, a little later.
"""

from __future__ import annotations

import gc

THRESHOLDS = (10_000, 10, 10)  # Python 3.11 sets (700, 10, 10)


def settle() -> None:
    """Collect once, freeze what is left, and turn the collector on at ``THRESHOLDS``."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    gc.enable()
