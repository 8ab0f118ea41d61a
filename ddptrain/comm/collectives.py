"""Launch a non-blocking sum all-reduce with the chosen implementation: gloo/NCCL's own, or our ring."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
import torch.distributed as dist

from ddptrain.comm.ring import ring_all_reduce

COLLECTIVES = ("native", "ring")


class Handle(Protocol):
    """What a launched collective returns; ``wait()`` blocks until the tensor holds the result."""

    def wait(self) -> object: ...


class _RingHandle:
    """A ring all-reduce running on the ring thread; on CUDA its kernels run on the ring's own stream."""

    def __init__(self, future: Future[tuple[int, torch.cuda.Event | None]], stream: torch.cuda.Stream | None) -> None:
        self._future = future
        self._stream = stream

    def wait(self) -> int:
        """Block the host until the ring has queued its work; on CUDA, order the caller's stream after it."""
        sent, done = self._future.result()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(done)  # the device waits, not the host
        return sent

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the ring is done, on the ring's stream (so CUDA events it records come after it)."""

        def run(_: Future[tuple[int, torch.cuda.Event | None]]) -> None:
            with _on(self._stream):
                callback()

        self._future.add_done_callback(run)


def when_done(handle: Handle, callback: Callable[[], None]) -> None:
    """Call ``callback`` when the collective completes, where a clock can see its end.

    gloo and the ring complete on their own threads, so the callback sees the real end on the host. An NCCL work's
    future completes once the work is enqueued, but its callback runs on a stream that waits for the collective,
    so a CUDA event recorded by the callback marks the device's end. The ring's callback runs on the ring's stream.
    """
    if isinstance(handle, _RingHandle):
        handle.add_done_callback(callback)
    else:
        handle.get_future().then(lambda _: callback())  # type: ignore[attr-defined]


def validate_collective(name: str) -> None:
    """Refuse an unknown ``parallel.collective`` with the key and the choices in the message."""
    if name not in COLLECTIVES:
        raise ValueError(f"parallel.collective={name!r}: expected one of {', '.join(COLLECTIVES)}")


def all_reduce_sum(tensor: torch.Tensor, collective: str, group: dist.ProcessGroup | None) -> Handle:
    """Start summing ``tensor`` in place over ``group``; the caller waits on the returned handle.

    The ring is sequential send/recv steps, so it runs on one background thread: launches stay non-blocking and
    the ring collectives run one at a time, in launch order, on every rank. On CUDA the ring runs on its own
    stream, which waits (on the device) for the gradient to be computed and never holds up the compute stream.
    """
    if collective == "native":
        return dist.all_reduce(tensor, group=group, async_op=True)
    validate_collective(collective)
    if not tensor.is_cuda:
        return _RingHandle(_ring_thread(None).submit(_ring, tensor, None, None, group), None)
    return _launch_on_ring_stream(tensor, tensor.device, group)


def _launch_on_ring_stream(tensor: torch.Tensor, device: torch.device, group: dist.ProcessGroup | None) -> _RingHandle:
    """Submit the ring on ``device``'s ring stream, after the work queued so far on the current stream.

    The caller joins (``wait``) before it lets go of ``tensor``, and the join orders its stream after the ring,
    so the allocator cannot hand the tensor's memory to compute while the ring still reads it.
    """
    stream = _ring_stream(device)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return _RingHandle(_ring_thread(device.index).submit(_ring, tensor, stream, ready, group), stream)


def _ring(
    tensor: torch.Tensor, stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None,
    group: dist.ProcessGroup | None,
) -> tuple[int, torch.cuda.Event | None]:
    """On the ring thread: the ring all-reduce, on ``stream`` once ``ready`` has passed; (bytes sent, done event)."""
    if stream is None:
        return ring_all_reduce(tensor, "sum", group), None
    # Waiting here, not at launch, keeps a queued ring from waiting for the gradients of rings launched after it.
    stream.wait_event(ready)
    with _on(stream):
        sent = ring_all_reduce(tensor, "sum", group)
        done = torch.cuda.Event()
        done.record(stream)
    return sent, done


def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


@functools.cache
def _ring_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


@functools.cache
def _ring_thread(device_index: int | None) -> ThreadPoolExecutor:
    """One ring thread per device. On CUDA it makes its device current first: a thread starts on GPU 0, and its
    first CUDA call would otherwise create a context there in every rank."""
    if device_index is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-ring")
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="ddptrain-ring", initializer=torch.cuda.set_device, initargs=(device_index,)
    )
