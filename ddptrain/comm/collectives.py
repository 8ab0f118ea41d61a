"""Launch a non-blocking sum all-reduce with the chosen implementation: gloo/NCCL's own, or our ring."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Protocol

import torch
import torch.distributed as dist

from ddptrain.comm.ring import ring_all_reduce

COLLECTIVES = ("native", "ring")


class Handle(Protocol):
    """What a launched collective returns; ``wait()`` blocks until the tensor holds the result."""

    def wait(self) -> object: ...


class _RingHandle:
    """A ring all-reduce running on the ring thread."""

    def __init__(self, future: Future[int]) -> None:
        self._future = future

    def wait(self) -> int:
        return self._future.result()


def when_done(handle: Handle, callback: Callable[[], None]) -> None:
    """Call ``callback`` when the collective completes, on the thread that completes it.

    gloo and the ring complete on their own threads, so the callback sees the real end; an NCCL work's future
    completes once the work is enqueued on its stream, so there the end is a lower bound.
    """
    if isinstance(handle, _RingHandle):
        handle._future.add_done_callback(lambda _: callback())
    else:
        handle.get_future().then(lambda _: callback())  # type: ignore[attr-defined]


def validate_collective(name: str) -> None:
    """Refuse an unknown ``parallel.collective`` with the key and the choices in the message."""
    if name not in COLLECTIVES:
        raise ValueError(f"parallel.collective={name!r}: expected one of {', '.join(COLLECTIVES)}")


def all_reduce_sum(tensor: torch.Tensor, collective: str, group: dist.ProcessGroup | None) -> Handle:
    """Start summing ``tensor`` in place over ``group``; the caller waits on the returned handle.

    The ring is sequential send/recv steps, so it runs on one background thread: launches stay non-blocking and
    the ring collectives run one at a time, in launch order, on every rank. On CUDA the ring's kernels go to the
    stream that was current at launch, as a native collective's would.
    """
    if collective == "native":
        return dist.all_reduce(tensor, group=group, async_op=True)
    validate_collective(collective)
    stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
    return _RingHandle(_ring_thread().submit(_ring_on_stream, tensor, stream, group))


def _ring_on_stream(tensor: torch.Tensor, stream: torch.cuda.Stream | None, group: dist.ProcessGroup | None) -> int:
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        return ring_all_reduce(tensor, "sum", group)


@functools.cache
def _ring_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-ring")
