"""A pytest plugin: under pytest-xdist each worker's torch computes on its own share of the cores.

ddptrain's launcher gives each of its workers a share of the cores (``ddptrain/app/launch.py``); the suite's
workers need the same. With torch's default of one thread per core, two workers on two cores ran four OpenMP
threads there, and their spin-waits took the in-process tests two to three times their CPU seconds (the fast
tier's ``test_chunked_loss.py``: 23 CPU s under ``-n 2``, 1.2 s with a thread per worker). Forked ranks take one
thread each already (``tests/helpers/dist.py``); a run without xdist keeps torch's default.
"""

from __future__ import annotations

import os

import pytest


def take_a_share_of_the_cores() -> None:
    """In a pytest-xdist worker: torch's threads are the cores over the workers (at least one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from ddptrain.runtime.topology import threads_per_worker  # the launcher's own rule

        torch.set_num_threads(threads_per_worker(workers))


def pytest_configure(config: pytest.Config) -> None:
    take_a_share_of_the_cores()
