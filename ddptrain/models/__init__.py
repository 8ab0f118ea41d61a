"""Model presets built from config, and their parameter and FLOP counts.

``build_model`` is imported on first use: the config checks in ``ddptrain.models.lora`` and the FLOP counts
need no ``transformers``, which the launcher process then never loads.
"""

from importlib import import_module
from typing import Any

__all__ = ["build_model", "model_vocab_size"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("ddptrain.models.build"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
