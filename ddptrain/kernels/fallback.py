"""``parallel.kernels=auto`` on CUDA: Triton's kernels, or torch's from the moment Triton's first launch fails.

Triton compiles a small C launcher with the host's C compiler against Python's headers at its first launch; where
either is missing (a slim container), that launch fails, and so would every later one. ``auto`` then finishes
the call and the run on the torch reference, after one warning; ``parallel.kernels=triton`` stops instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ddptrain.kernels.reference import TorchKernels

log = logging.getLogger(__name__)
T = TypeVar("T")


class FirstLaunchError(RuntimeError):
    """Triton's first kernel launch in this process failed: no kernel ran, so the call can be redone on torch."""


class FallbackKernels(TorchKernels):
    """Calls ``fused``; when its first launch fails, warns once and calls ``reference`` from then on.

    A failure after a launch has succeeded is a real error and propagates: by then the launcher builds, and a
    half-done call could not safely be redone.
    """

    def __init__(self, fused: TorchKernels, reference: TorchKernels) -> None:
        self.active = fused
        self._reference = reference
        self._lock = threading.Lock()  # a collective's completion callback may launch while the main thread does

    @property  # type: ignore[override]
    def name(self) -> str:
        """The name of the kernels that run now: ``triton`` until a fallback, then ``torch``."""
        return self.active.name

    def copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        self._call(lambda k: k.copy_(dsts, srcs, scale))

    def scale_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        self._call(lambda k: k.scale_(tensors, coef))

    def squared_norm(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._call(lambda k: k.squared_norm(tensors))

    def cast_(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, stochastic: bool = False,
              seed: int = 0) -> None:
        self._call(lambda k: k.cast_(dst, src, scale, stochastic, seed))

    def _call(self, run: Callable[[TorchKernels], T]) -> T:
        kernels = self.active
        try:
            return run(kernels)
        except FirstLaunchError as exc:
            with self._lock:
                if self.active is kernels:  # another thread's failed first launch may have switched already
                    log.warning("parallel.kernels=auto: %s; the run goes on with torch's kernels (install a C "
                                "compiler and Python's headers for Triton's)", exc)
                    self.active = self._reference
            return run(self._reference)
