"""Which ranks hold the same bits of the model: the groups the replica drift check compares within.

- torch DDP, ZeRO-1 and our engines: every rank holds every parameter (ZeRO-1's owners broadcast theirs after each
  update), so the world is one group of whole replicas.
- FSDP2 over every rank (``parallel.zero_stage=2|3``): each parameter shard lives on one rank only (ZeRO-2 here
  reshards after backward too, so between steps its parameters are sharded as ZeRO-3's). No two ranks hold the
  same bits, so nothing can drift apart, and nothing is compared: a changed shard is the model every rank gathers.
- HSDP (``parallel.shard_group=node``): the 2-D mesh replicates each node's shards across nodes, so the ranks with
  the same place in their node (one column of the mesh) hold the same shard: one group per shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class ReplicaGroups:
    """The groups of ranks that hold the same parameter bits, and this rank's."""

    members: tuple[tuple[int, ...], ...]  # each group's global ranks, ascending; () when nothing is replicated
    slot: int  # this rank's group: its index in ``members``
    group: dist.ProcessGroup | None  # this rank's group for collectives (None: the default group, the world)
    sharded: bool  # the parameters are FSDP2 shards (DTensors)

    @property
    def comparable(self) -> bool:
        """True when some rank holds bits another rank holds too."""
        return bool(self.members) and len(self.members[0]) > 1

    def describe(self) -> str:
        """What the drift check compares, for the start-up log."""
        if not self.comparable:
            return ("nothing to compare: each parameter shard is held by one rank only (FSDP2 over every rank; "
                    "parallel.shard_group=node replicates shards across nodes)" if self.sharded else
                    "nothing to compare")
        if len(self.members) == 1:
            return f"whole replicas on {len(self.members[0])} ranks"
        groups = ", ".join("(" + ", ".join(map(str, m)) + ")" for m in self.members)
        return f"each shard's {len(self.members[0])} replicas across nodes: ranks {groups}"


def replica_groups(model: torch.nn.Module) -> ReplicaGroups:
    """The replica groups of ``model``'s parameters as this rank holds them (after wrapping)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not dtensors:
        return ReplicaGroups((tuple(range(world)),) if world > 1 else (), 0, None, False)
    mesh, placements = dtensors[0].device_mesh, dtensors[0].placements
    if any(p.device_mesh != mesh or p.placements != placements for p in dtensors):
        raise ValueError("the drift check expects every FSDP2 parameter on one mesh with one placement")
    replicated = [dim for dim, placement in enumerate(placements) if placement.is_replicate()]
    if not replicated:
        return ReplicaGroups((), 0, None, True)
    (dim,) = replicated  # HSDP: (Replicate, Shard(0)) on a (nodes, ranks per node) mesh
    columns = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()  # a CPU tensor: no device read
    members = tuple(tuple(sorted(column)) for column in columns)
    slot = next(i for i, ranks in enumerate(members) if rank in ranks)
    return ReplicaGroups(members, slot, mesh.get_group(dim), True)


def local_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's name and the tensor this rank holds of it (an FSDP2 shard's local part)."""
    for name, param in model.named_parameters():
        yield name, (param.to_local() if isinstance(param, DTensor) else param).detach()


def rebroadcast(tensors: list[torch.Tensor], source: int, groups: ReplicaGroups) -> None:
    """Overwrite ``tensors`` on every rank of this rank's group with global rank ``source``'s."""
    for tensor in tensors:
        dist.broadcast(tensor, src=source, group=groups.group)
