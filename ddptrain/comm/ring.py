"""Ring all-reduce from point-to-point send/recv: a ring reduce-scatter, then a ring all-gather."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

OPS = ("sum", "avg")
_local = threading.local()


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> int:
    """Reduce ``tensor`` in place over ``group`` and return the bytes this rank sent.

    The flat tensor is cut into N nearly equal chunks (any length works; some chunks may be empty). In N-1
    reduce-scatter steps each rank passes a partial sum to its right neighbour, ending with one fully reduced
    chunk; N-1 all-gather steps then circulate the reduced chunks. Each rank sends 2(N-1)/N · D bytes.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}: expected one of {', '.join(OPS)}")
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    rank = dist.get_rank(group)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = torch.tensor_split(work.view(-1), world)
    scratch = _receive_buffer(chunks[0])  # tensor_split puts the longer chunks first
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0
    for step in range(world - 1):
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = scratch[: recv.numel()]
        sent += _exchange(send, incoming, right, left, group)
        recv.add_(incoming)
    if op == "avg":  # divide the one chunk this rank owns, so every rank ends with the same bits
        chunks[(rank + 1) % world].div_(world)
    for step in range(world - 1):
        send, recv = chunks[(rank - step + 1) % world], chunks[(rank - step) % world]
        sent += _exchange(send, recv, right, left, group)
    if work is not tensor:
        tensor.copy_(work)
    return sent


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group: dist.ProcessGroup | None) -> int:
    """Send ``send`` to the right neighbour while receiving ``recv`` from the left; empty chunks travel not at all.

    Both neighbours compute the same chunk sizes, so a skipped send always meets a skipped receive.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=left))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return send.numel() * send.element_size()


def _receive_buffer(like: torch.Tensor) -> torch.Tensor:
    """Room for one chunk, kept per thread on CPU: a fresh large tensor costs a page fault per 4 KB on every call.

    Device allocators (CUDA's caching one) already reuse memory, and a shared buffer could race across streams.
    """
    if like.device.type != "cpu":
        return torch.empty_like(like)
    buffers: dict[torch.dtype, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(like.dtype)
    if buf is None or buf.numel() < like.numel():
        buf = buffers[like.dtype] = torch.empty(like.numel(), dtype=like.dtype)
    return buf[: like.numel()]
