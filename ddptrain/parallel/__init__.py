"""The data-parallel strategy: torch DDP or a from-scratch engine, with communication hooks."""

from ddptrain.parallel.wrap import sync_context, validate_parallel_config, wrap_model

__all__ = ["sync_context", "validate_parallel_config", "wrap_model"]
