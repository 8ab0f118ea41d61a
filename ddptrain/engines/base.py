"""The torch-DDP contract every from-scratch engine keeps; a subclass picks only its policy and ordering."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.comm import broadcast_coalesced, validate_collective
from ddptrain.engines.reducer import InlineOrdering, Ordering, Policy, Reducer
from ddptrain.engines.stats import CommStats
from ddptrain.kernels import select_kernels


class DataParallelEngine(nn.Module):
    """Wraps ``module`` like ``DistributedDataParallel``: same constructor, ``.module``, ``forward``, ``no_sync()``.

    Rank 0's parameters are copied to every rank here. With ``broadcast_buffers`` its buffers are too, and again
    before each forward that follows a synchronised one; without it buffers stay rank-local, even here, as with
    torch DDP's ``broadcast_buffers=False``. When ``loss.backward()`` returns, every ``.grad`` holds the average.
    ``kernels`` (``parallel.kernels``) picks who packs, averages and unpacks the buckets: Triton or torch.
    """

    policy: ClassVar[Policy]

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        collective: str = "native",
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        validate_collective(collective)
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        broadcast_coalesced([*module.parameters(), *(module.buffers() if broadcast_buffers else ())], process_group)
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        device = trainable[0][1].device if trainable else torch.device("cpu")
        self.reducer = Reducer(
            trainable, self.policy, self._ordering(device), process_group, collective,
            bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters, select_kernels(kernels, device),
        )  # fmt: skip

    def _ordering(self, device: torch.device) -> Ordering:
        """Which stream collectives run on; the stream-bucketed engine overrides this."""
        return InlineOrdering()

    @property
    def comm_stats(self) -> CommStats:
        """Bytes and time of gradient sync in the last synchronised backward."""
        return self.reducer.stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        buffers = list(self.module.buffers())
        if self.require_forward_param_sync and self.broadcast_buffers and buffers:
            broadcast_coalesced(buffers, self.process_group)
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output if self.find_unused_parameters else None)
        else:
            self.require_forward_param_sync = False
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised backward after the context averages the total."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
