"""What a tokenizer worker process runs: documents -> their ids, each followed by EOS, as one flat array.

Kept apart so that a worker imports only ``tokenizers`` and ``numpy`` (not torch) when it starts.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

_WORKER: dict[str, Any] = {}  # this process's tokenizer and EOS id, set by start_worker


def start_worker(tokenizer_json: str, eos: int, in_pool: bool = True) -> None:
    """Build the tokenizer once per process; a pool's workers run one thread each (the pool is the parallelism)."""
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Ctrl-C reaches the whole process group: the preparing process decides (it stops the pool and keeps
        # what is finished); a worker interrupted mid-batch would only add its own traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), eos=eos)


def encode_documents(texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids, each followed by EOS, concatenated; and each document's length (EOS included)."""
    encodings = _WORKER["tokenizer"].encode_batch(texts, add_special_tokens=False)
    eos = _WORKER["eos"]
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    out = np.empty(int(lengths.sum()), dtype=np.dtype(dtype))
    at = 0
    for e, n in zip(encodings, lengths, strict=True):
        out[at : at + n - 1] = e.ids
        out[at + n - 1] = eos
        at += n
    return out, lengths
