"""Gradient buckets: which parameters share one collective, and where their gradients wait for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddptrain.comm import Handle
from ddptrain.kernels import TorchKernels


def assign_buckets(params: Sequence[nn.Parameter], cap_bytes: int | None) -> list[list[int]]:
    """Parameter indices per bucket, filled in reverse parameter order, the order backward produces gradients.

    A bucket closes once it holds ``cap_bytes`` (so one large tensor gets a bucket of its own); parameters of
    another dtype or device go to buckets of their own. ``cap_bytes=None`` gives one parameter per bucket.
    """
    if cap_bytes is None:
        return [[i] for i in reversed(range(len(params)))]
    closed: list[list[int]] = []
    filling: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        key = (params[i].dtype, params[i].device)
        indices, size = filling.pop(key, ([], 0))
        indices.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap_bytes:
            closed.append(indices)
        else:
            filling[key] = (indices, size)
    buckets = closed + [indices for indices, _ in filling.values()]
    return sorted(buckets, key=lambda indices: -indices[0])


class Bucket:
    """Gradients reduced by one collective: a flat buffer with one view per parameter, or (``flat=False``, one
    parameter) that parameter's gradient reduced in place."""

    def __init__(self, indices: list[int], params: list[nn.Parameter], flat: bool, as_view: bool) -> None:
        self.indices = indices
        self.params = params
        self.as_view = as_view
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        if flat:
            sizes = [p.numel() for p in params]
            self.buffer = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)
            self.views = [part.view(p.shape) for p, part in zip(params, self.buffer.split(sizes), strict=True)]
        self.pending = len(params)
        self.tensor: torch.Tensor | None = self.buffer
        self.handle: Handle | None = None

    def reset(self) -> None:
        self.pending = len(self.params)
        self.tensor = self.buffer
        self.handle = None

    def add(self, slot: int, locally_used: bool) -> None:
        """Note one gradient ready; unbucketed, it becomes the tensor the collective reduces.

        A parameter this rank did not use contributes zeros, or its stale gradient (as in torch DDP), never
        modifying that gradient in place. Flat buckets copy their gradients in ``pack``, all in one go.
        """
        self.pending -= 1
        if self.buffer is not None:
            return
        grad = self.params[slot].grad
        self.tensor = torch.zeros_like(self.params[slot]) if grad is None else grad if locally_used else grad.clone()

    def pack(self, kernels: TorchKernels) -> None:
        """Copy every gradient that is not already its bucket view into the flat buffer: one launch per bucket."""
        if self.buffer is None:
            return
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() != view.data_ptr():
                dsts.append(view)
                srcs.append(param.grad)
        kernels.copy_(dsts, srcs)
        if self.as_view:
            for param, view in zip(self.params, self.views, strict=True):
                if param.grad is not None:
                    param.grad = view

    def finish(self, used: Sequence[bool] | None, scale: float, kernels: TorchKernels) -> None:
        """Hand the summed values times ``scale`` (1/world: the average) to ``.grad`` in one launch; a parameter
        that no rank used keeps its gradient, averaged only if the collective summed it in place (a bucket view)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for slot, (index, param) in enumerate(zip(self.indices, self.params, strict=True)):
            reduced = self.tensor if self.buffer is None else self.views[slot]
            assert reduced is not None
            in_place = param.grad is not None and param.grad.data_ptr() == reduced.data_ptr()
            if used is not None and not used[index] and not in_place:
                continue
            if param.grad is None:
                param.grad = reduced if self.buffer is None or self.as_view else torch.empty_like(reduced)
            dsts.append(param.grad)  # the reduced tensor itself when the gradient is its view: scaled in place
            srcs.append(reduced)
        kernels.copy_(dsts, srcs, scale)
