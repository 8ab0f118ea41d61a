"""Per-device peak dense bf16 throughput, and model FLOPs utilisation (MFU) against it.

Figures are the vendors' datasheet tensor-core numbers without sparsity (the "with sparsity" figure halved),
bf16 with fp32 accumulation, which is what a PyTorch bf16 matmul runs.
"""

from __future__ import annotations

import re

# First match wins, so specific names come before the families they belong to (H100 NVL before H100).
_PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"\bGB200\b", 2500.0),
    (r"\bB200\b", 2250.0),
    (r"\bGH200\b", 989.0),
    (r"\bH200 NVL\b", 835.0),
    (r"\bH200\b", 989.0),
    (r"\bH100 NVL\b", 835.0),
    (r"\bH100 PCIE\b", 756.0),
    (r"\bH100\b", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"\bH800\b", 989.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),  # not the A10G, whose tensor peak NVIDIA does not publish
    (r"\bRTX 4090\b", 165.0),
    (r"\bRTX 3090\b", 71.0),
    (r"\bMI300X\b", 1307.0),
]


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak for a ``torch.cuda.get_device_name()`` string; None for an unknown device or a CPU."""
    name = device_name.upper()
    return next((peak for pattern, peak in _PEAK_BF16_TFLOPS if re.search(pattern, name)), None)


def mfu(achieved_tflops: float, peak: float | None) -> float | None:
    """Achieved model TFLOP/s over the peak; None when the peak is unknown or the ratio exceeds 1.

    A ratio above 1 is impossible, so it means the peak is wrong for this device (or FLOPs are overcounted):
    reporting no MFU is better than a false or clamped one.
    """
    if not peak:
        return None
    ratio = achieved_tflops / peak
    return ratio if ratio <= 1.0 else None
