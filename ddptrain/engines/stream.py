"""Step 5: the bucketed engine with collectives on a dedicated CUDA stream, ordered against compute by events."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ddptrain.comm import Handle
from ddptrain.engines.bucketed import BucketedDDP
from ddptrain.engines.reducer import InlineOrdering, Ordering

log = logging.getLogger(__name__)


class SideStream:
    """Runs each collective on one communication stream that waits for the gradients, never for later compute."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def launch(self, tensor: torch.Tensor, start: Callable[[], Handle]) -> Handle:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            tensor.record_stream(self.stream)  # the allocator must not reuse it before the collective is done
            return start()

    def join(self, handle: Handle) -> None:
        with torch.cuda.stream(self.stream):
            handle.wait()
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)


class StreamBucketedDDP(BucketedDDP):
    """``BucketedDDP`` whose collectives run on a side stream on CUDA; elsewhere it is ``BucketedDDP``."""

    def _ordering(self, device: torch.device) -> Ordering:
        if device.type == "cuda":
            return SideStream(device)
        _warn_no_cuda(device.type)
        return InlineOrdering()


@functools.cache
def _warn_no_cuda(device_type: str) -> None:
    log.warning("stream_bucketed: parameters are on %s, not CUDA; running as the bucketed engine", device_type)
