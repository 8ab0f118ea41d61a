"""Fused kernels for the element-wise work around gradient collectives, chosen by ``parallel.kernels``.

Packing gradients into a bucket and unpacking it (with the average after a SUM all-reduce fused in), the
multi-tensor squared norm and clip scaling, and the fp32/bf16 casts of compression: each is one memory-bound
pass per byte. ``auto`` runs the Triton kernels on CUDA when Triton is importable and the torch reference
otherwise, and falls back to the reference, with one warning, when Triton's first launch fails (no C compiler);
``triton`` where Triton cannot run is a start-up error. Triton is imported only when chosen.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ddptrain.errors import ConfigError
from ddptrain.kernels.fallback import FallbackKernels
from ddptrain.kernels.reference import TorchKernels

TORCH_KERNELS = TorchKernels()


def triton_unavailable(device_type: str) -> str | None:
    """Why Triton's kernels cannot run on ``device_type`` here, or None when they can.

    They run on CUDA, or on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, for tests): the
    interpreter reads host memory, so it cannot serve CUDA tensors.
    """
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
    if device_type == "cuda":
        return "TRITON_INTERPRET is set, and the interpreter cannot run on CUDA tensors" if interpreted else None
    if interpreted:
        return None
    return f"Triton compiles for CUDA devices, and this run is on {device_type}"


def check_kernels(mode: str, device_type: str) -> None:
    """Start-up check (``mode`` is ``parallel.kernels``): a ConfigError for ``triton`` where Triton cannot run."""
    reason = triton_unavailable(device_type) if mode == "triton" else None
    if reason is not None:
        raise ConfigError(f"parallel.kernels=triton cannot run here: {reason}; use parallel.kernels=auto or torch")


def select_kernels(mode: str, device: torch.device) -> TorchKernels:
    """The kernels ``mode`` picks for tensors on ``device``: Triton's (checked; under ``auto``, with the fallback
    to torch's if their first launch fails) or the torch reference."""
    check_kernels(mode, device.type)
    if mode == "torch" or (mode == "auto" and (device.type != "cuda" or triton_unavailable("cuda"))):
        return TORCH_KERNELS
    return _auto_kernels() if mode == "auto" else _triton_kernels()


@functools.cache
def _triton_kernels() -> TorchKernels:
    from ddptrain.kernels.triton_ops import TritonKernels

    return TritonKernels()


@functools.cache
def _auto_kernels() -> FallbackKernels:
    """One per process, so the first failed launch switches the engines, the clip and the hook together."""
    return FallbackKernels(_triton_kernels(), TORCH_KERNELS)


__all__ = ["TORCH_KERNELS", "TorchKernels", "check_kernels", "select_kernels", "triton_unavailable"]
