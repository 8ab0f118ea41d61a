"""Replica groups of torchft on this machine, for component tests: a lighthouse (torchft's own server) and one
group per thread, each with its own TCPStore, gloo process group and ``Manager`` (one worker per group), as
torchft's own integration tests run them (``torchft/local_sgd_integ_test.py``). Threads, not processes: no
interpreter start-up or torch import per group, so a two-group check costs about a second of CPU.

The manager is the one DiLoCo needs: a synchronous quorum (``use_async_quorum=False``), and ``init_sync=False``
(every group starts from the same seeded weights, so none heals from another at step 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torchft.manager import Manager

T = TypeVar("T")
TIMEOUT = timedelta(seconds=20)  # a group that never comes makes the others fail after this, not hang


@contextmanager
def lighthouse(min_replicas: int, heartbeat_timeout_ms: int = 5000) -> Iterator[str]:
    """A lighthouse on a free port; its address (http://host:port). A group whose heartbeats stopped counts as
    healthy (a quorum may wait for it) for ``heartbeat_timeout_ms`` (torchft's default: 5 s)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=200,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    try:
        yield server.address()
    finally:
        server.shutdown()


@contextmanager
def group_manager(address: str, group: int, min_replicas: int) -> Iterator[Manager]:
    """Replica group ``group``'s manager (one worker), its own TCPStore, under the lighthouse at ``address``; shut
    down on leaving (what a group's death looks like to the others: its heartbeats stop)."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        use_async_quorum=False, replica_id=f"g{group}", lighthouse_addr=address, rank=0, world_size=1,
        store_addr="localhost", store_port=store.port, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT, init_sync=False,
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)


def _group(address: str, group: int, groups: int, body: Callable[[Manager, int], T]) -> T:
    with group_manager(address, group, groups) as manager:
        return body(manager, group)


def run_groups(groups: int, body: Callable[[Manager, int], T]) -> list[T]:
    """``body(manager, group)`` in each of ``groups`` replica groups at once, under a fresh lighthouse that needs
    all of them; their results in group order (a group's exception is raised here)."""
    with lighthouse(groups) as address, ThreadPoolExecutor(groups, thread_name_prefix="ft-group") as pool:
        futures = [pool.submit(_group, address, g, groups, body) for g in range(groups)]
        return [f.result(timeout=4 * TIMEOUT.total_seconds()) for f in futures]
