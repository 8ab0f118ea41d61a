"""Where the ranks live: nodes, ranks per node, hosts, and whether every node sees the same run directory.

A job spans ``num_nodes`` nodes of ``local_world_size`` ranks each (torchrun's ``LOCAL_WORLD_SIZE`` and
``GROUP_RANK``). ddptrain needs the run directory on storage that every node mounts (a shared filesystem):
checkpoints hold every rank's RNG state and, with ZeRO, every rank's shards, and a resumed run must find
them all. The data cache need not be shared: each node's first rank prepares its own copy.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import DistEnv

log = logging.getLogger(__name__)


def threads_per_worker(workers: int, busy: float = 0.0) -> int:
    """Each of ``workers`` processes on one machine computes on its share of the cores that the rest of the
    machine leaves idle (at least one thread): more threads than idle cores spin against each other and against
    the other jobs. ``busy``: how many cores the rest of the machine keeps busy (the launcher passes the 1-minute
    load average; 0: a machine of our own).

    Measured (scripts/bench_threads.py, docs/benchmarks.md): one worker on the shared 2-core machine at a load
    average of 11-14 trained at 133 tok/s with 2 threads against 912 with 1 (0.15x); with 2 threads on 2 idle
    cores it keeps torch's default of a thread per core.
    """
    cores = os.cpu_count() or 1
    idle = max(1.0, cores - busy)
    return max(1, min(cores // workers, round(idle / workers)))


def oversubscription_note(workers: int) -> str | None:
    """One line when ``workers`` processes on this machine outnumber its cores (``launch.nproc_per_node=8`` on 2
    cores): each gets one thread and they take turns on the cores, so the run is slower than with as many workers
    as cores, and a user should hear it before the run starts rather than read it off the throughput."""
    cores = os.cpu_count() or 1
    if workers <= cores:
        return None
    return (f"ddptrain: note: launch.nproc_per_node={workers} workers on {cores} cores: each gets one thread and "
            f"they take turns on the cores (launch.nproc_per_node={cores} trains faster here)")


@dataclass(frozen=True)
class Topology:
    """Every rank's host and node, gathered once at start-up."""

    hosts: list[str]  # by rank
    nodes: list[int]  # by rank: torchrun's node (agent) rank
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def describe(self) -> str:
        """One line: nodes x ranks per node, and the hosts."""
        hosts = sorted(set(self.hosts))
        return (f"{self.num_nodes} node(s) x {self.local_world_size} rank(s) per node on "
                f"{len(hosts)} host(s): {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}")


def gather_topology(env: DistEnv) -> Topology:
    """Every rank's (host, node rank), from one all-gather."""
    mine = (socket.gethostname(), env.node_rank)
    every: list[tuple[str, int]] = [mine] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return Topology([h for h, _ in every], [n for _, n in every], env.local_world_size)


def check_shared_run_dir(path: Path) -> None:
    """Refuse a run directory that some rank cannot see rank 0's files in (no shared filesystem).

    Rank 0 writes a probe file with a random name; every rank looks for it under its own ``path`` (which is
    rank 0's path, broadcast). Raises the same ConfigError on every rank, naming the ranks and hosts that miss it.
    """
    box = [f".shared-probe-{secrets.token_hex(8)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    probe = path / str(box[0])
    if dist.get_rank() == 0:
        probe.touch()
    dist.barrier()
    seen = (probe.is_file(), socket.gethostname())
    every: list[tuple[bool, str]] = [seen] * dist.get_world_size()
    dist.all_gather_object(every, seen)
    dist.barrier()  # every rank has looked before rank 0 removes the probe
    if dist.get_rank() == 0:
        probe.unlink()
    blind = [f"{rank} ({host})" for rank, (ok, host) in enumerate(every) if not ok]
    if blind:
        raise ConfigError(
            f"hydra.run.dir={path}: not shared by every node (rank(s) {', '.join(blind)} cannot see rank 0's files); "
            "put the run directory on a filesystem every node mounts: checkpoints need every rank's files in one place"
        )
