"""Corpus -> tokenizer -> token shards (or a stream) -> per-rank micro batches; the batch arithmetic.

The batch arithmetic and the source check need no data library, so they import none: the launcher process
checks a config without loading ``datasets`` and ``transformers`` (seconds per process). The data set and the
loader are imported on first use.
"""

from importlib import import_module
from typing import Any

from ddptrain.data.batch import BatchShape
from ddptrain.data.corpus import validate_source

_LAZY = {"TokenData": "types", "build_token_data": "dataset", "MicroBatches": "loader", "SampleOrder": "loader",
         "eval_batches": "loader"}

__all__ = ["BatchShape", "MicroBatches", "SampleOrder", "TokenData", "build_token_data", "eval_batches",
           "validate_source"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"ddptrain.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
