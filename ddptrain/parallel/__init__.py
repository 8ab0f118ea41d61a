"""The data-parallel strategy: torch DDP (+ compression hooks, ZeRO-1), FSDP2 (ZeRO-2/3), or our engines."""

from ddptrain.parallel.wrap import Wrapped, wrap_model

__all__ = ["Wrapped", "wrap_model"]
