"""Broadcast many tensors from one rank as one flat message per dtype and device (DDP's coalesced broadcast)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


@torch.no_grad()
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, group_src: int = 0
) -> None:
    """Overwrite ``tensors`` in place with rank ``group_src``'s values: one collective per dtype/device, not per tensor.

    The copy-back keeps each tensor's autograd version counter, as DDP does, so a broadcast between a forward and
    its backward does not invalidate tensors saved for backward.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, group=group, group_src=group_src)
        with torch.autograd._unsafe_preserve_version_counter(tuple(same)):
            for t, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(part.view_as(t))
