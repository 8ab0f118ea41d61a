"""bitsandbytes' 4-bit matmul as its kernel runs it, for the storage tracker (``telemetry/storage_peak.py``): a
fake kernel shows only the op's output, the real one holds a dequantized copy of the weight while it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddptrain.models.lora import quiet_bitsandbytes

quiet_bitsandbytes()  # before bitsandbytes' first import, which warns on CPU about an optional kernel package
import bitsandbytes  # noqa: E402,F401  (registers the bitsandbytes ops)


def _gemm_4bit_dequantizing(keep_scales: bool) -> Callable[..., torch.Tensor]:
    """``gemm_4bit`` as bitsandbytes runs it for a training batch: the block scales dequantized, the weight
    dequantized into a temporary in the input's dtype, then a dense ``linear``. CPU runs this always (the
    default kernel); CUDA runs it above 1536 rows (``_dequant_linear_fallback``), which keeps the dequantized
    scales alive beside their offset-added copy until it returns (``keep_scales``)."""

    def gemm_4bit(A: torch.Tensor, B: torch.Tensor, shapeB: Any, absmax: torch.Tensor, blocksize: int,
                  quant_type: str, *optional: torch.Tensor | None) -> torch.Tensor:
        # the op's optional arguments, in its schema's order: bias, then double quantization's 8-bit scales,
        # their code table and offset
        bias, absmax_8bit, absmax_code, absmax_offset = (*optional, None, None, None, None)[:4]
        scales = None
        if absmax_8bit is not None:
            scales = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256,
                                                                        torch.float32)
            absmax = scales + absmax_offset
            if not keep_scales:
                del scales
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        return torch.nn.functional.linear(A, weight, bias)

    return gemm_4bit


def kernel_compositions(device_type: str) -> dict[Any, Callable[..., torch.Tensor]]:
    """Ops the tracker runs as their kernel on ``device_type`` composes them, so that it sees the kernel's
    temporaries (a fake kernel shows only the output)."""
    return {torch.ops.bitsandbytes.gemm_4bit.default: _gemm_4bit_dequantizing(keep_scales=device_type == "cuda")}
