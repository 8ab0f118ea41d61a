"""The GPU memory in use before this process creates its process groups, read once for ``auto`` to plan from.

``data.micro_batch_size=auto`` chooses after the process group exists (its all-reduce agrees on the choice), and
with ``device_id`` torch initializes NCCL's communicator eagerly: memory read as in use then holds NCCL's own
init allocations, which the planner counts again in its NCCL allowance. So ``distributed`` reads the device's
memory in use just before it creates the group, and the planner takes the smaller of that and the memory in use
when it plans. Only this module's reading is kept, for the life of the group; it imports nothing but torch.
"""

from __future__ import annotations

import torch

_in_use: dict[int, int] = {}  # device index: bytes in use (total less free) before the process groups existed


def note(device: torch.device) -> None:
    """Read ``device``'s memory in use now (a CUDA device; nothing for others). The reading includes this
    process's CUDA context: ``mem_get_info`` creates it if nothing has yet."""
    if device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    free, total = torch.cuda.mem_get_info(index)
    _in_use[index] = total - free


def forget() -> None:
    """Drop the readings (the groups are gone; a later group reads again)."""
    _in_use.clear()


def in_use_before_groups(index: int) -> int | None:
    """Bytes in use on device ``index`` before the process groups existed, or None when not read."""
    return _in_use.get(index)
