"""The torch reference of every fused kernel: what the Triton kernels must equal, and the path used without them.

Each method is the plain torch sequence (one op per tensor, or per pass) that the fused kernel replaces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TorchKernels:
    """Element-wise passes around gradient collectives, done with torch ops."""

    name = "torch"

    def copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """``dst = src * scale`` for each pair: packing gradients into a bucket (scale 1), unpacking it into the
        gradients with the average after a SUM all-reduce fused in (scale 1/world). A destination may be its
        own source (in place), never a partial overlap of it."""
        for dst, src in zip(dsts, srcs, strict=True):
            if scale == 1.0:
                dst.copy_(src)
            else:
                torch.mul(src, scale, out=dst)

    def scale_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the device scalar ``coef`` (the clip coefficient: no host sync)."""
        if tensors:
            torch._foreach_mul_(list(tensors), coef)

    def squared_norm(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The squared global L2 norm of all tensors, accumulated in fp32 (0 for none)."""
        sums = [t.float().square().sum() for t in tensors]  # torch's cascade sum: accurate in fp32
        return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float32)

    def cast_(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, stochastic: bool = False,
              seed: int = 0) -> None:
        """``dst = src * scale`` in ``dst``'s dtype: the scale is applied in the wider of the two dtypes, then one
        rounding (to nearest even; with ``stochastic``, fp32 to bf16 rounds up with probability equal to the
        dropped fraction, drawn from ``seed``)."""
        scaled = src if scale == 1.0 else src.to(torch.promote_types(src.dtype, dst.dtype)) * scale
        if stochastic and src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
            dst.copy_(stochastic_bf16(scaled, seed))
        else:
            dst.copy_(scaled)


def stochastic_bf16(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the fraction dropped: 16 random bits are added to
    the 16 bits that truncation drops. Unbiased: the expected result is ``x``. NaN stays NaN."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    generator = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int64)
    high = ((bits + noise) >> 16) & 0xFFFF
    rounded = torch.where(high >= 1 << 15, high - (1 << 16), high).to(torch.int16).view(torch.bfloat16)
    return torch.where(x.isnan(), x.to(torch.bfloat16), rounded)
