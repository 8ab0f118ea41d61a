"""From-scratch data-parallel engines, drop-in equals of torch DDP, chosen by ``parallel.engine``.

naive -> overlap_sync -> overlap_async -> bucketed -> stream_bucketed: each step changes one policy of the
shared reducer, so each shows what one idea of data-parallel training buys.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ddptrain.engines.base import DataParallelEngine
from ddptrain.engines.bucketed import BucketedDDP
from ddptrain.engines.naive import NaiveDDP
from ddptrain.engines.overlap import OverlapAsyncDDP, OverlapSyncDDP
from ddptrain.engines.stats import CommStats
from ddptrain.engines.stream import StreamBucketedDDP

ENGINES: dict[str, type[DataParallelEngine]] = {
    "naive": NaiveDDP,
    "overlap_sync": OverlapSyncDDP,
    "overlap_async": OverlapAsyncDDP,
    "bucketed": BucketedDDP,
    "stream_bucketed": StreamBucketedDDP,
}


def build_engine(name: str, module: nn.Module, **kwargs: Any) -> DataParallelEngine:
    """Wrap ``module`` in the engine called ``name``; ``kwargs`` are torch DDP's, plus ``collective``."""
    if name not in ENGINES:
        raise ValueError(f"parallel.engine={name!r}: expected one of {', '.join(ENGINES)}")
    return ENGINES[name](module, **kwargs)


__all__ = [
    "ENGINES",
    "BucketedDDP",
    "CommStats",
    "DataParallelEngine",
    "NaiveDDP",
    "OverlapAsyncDDP",
    "OverlapSyncDDP",
    "StreamBucketedDDP",
    "build_engine",
]
