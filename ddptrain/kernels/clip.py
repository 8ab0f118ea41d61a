"""Global-norm gradient clipping on the chosen kernels: one norm launch and one scale launch for all gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from ddptrain.kernels import TORCH_KERNELS, select_kernels


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None, mode: str) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (norm 2) on the kernels ``mode`` picks; returns the norm before clipping.
    ``max_norm=None`` computes the norm only, without a scaling pass.

    The torch reference is torch's own functions, which also take sharded (DTensor) gradients, whose norm needs
    a reduction across ranks, and gradients spread over several devices. The coefficient stays on the device:
    clipping never waits for the host.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    fusable = grads and not any(isinstance(g, DTensor) for g in grads) and len({g.device for g in grads}) == 1
    # ``auto`` clips with torch's: on an H100 the fused norm and scale took 1.6-2.7x torch's foreach time at every
    # size from 1 MB to 1 GB (docs/benchmarks.md, "On a GPU"); ``triton`` still asks for them
    kernels = select_kernels(mode, grads[0].device) if fusable and mode != "auto" else TORCH_KERNELS
    if kernels.name == "torch":
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = kernels.squared_norm(grads).sqrt()
    if max_norm is not None:
        kernels.scale_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))  # torch's coefficient, eps included
    return total
