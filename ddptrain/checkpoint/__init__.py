"""Checkpoints in one logical format that any strategy and world size can resume, and the offline tools.

Layout of ``<run dir>/<checkpoint.dir>/step_000010/``: ``COMMITTED`` (JSON, written last: step, strategy, world
size, parameter count, model fingerprint), ``trainer.pt`` (step, LR schedule, global data position, the real tokens
trained on before it, batch), ``config.yaml`` (the run's config), ``hf/`` (the model's ``config.json`` and the
tokenizer, so the model can be rebuilt without the run), ``rng/rank{r}.pt`` (every rank's RNG states) and
``state/``: one torch.distributed.checkpoint directory holding model and optimizer state keyed by parameter name,
whatever the strategy (torch DDP, our engines, ZeRO-1, FSDP2 ZeRO-2/3) that wrote it.

A directory without ``COMMITTED`` is a save that died half way: it is ignored and removed.
``CheckpointManager`` (``manager.py``) holds a run's stateful parts by key and decides when to save them;
``Checkpointer`` writes, commits, finds and loads the files; ``format.py`` is what every reader and writer shares
(the marker, ``trainer.pt``, the fingerprint, the damage checks).
``offline.py`` reads checkpoints without a run (the ``ddptrain-ckpt`` command, ``cli.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.checkpoint.checkpointer import Checkpointer
    from ddptrain.checkpoint.format import MARKER, TrainState, model_fingerprint
    from ddptrain.checkpoint.manager import CheckpointManager

__all__ = ["MARKER", "CheckpointManager", "Checkpointer", "TrainState", "model_fingerprint"]
# Each name from its module when first asked for: the launcher reads a run's checkpoints (``format``,
# ``before_start``) without importing torch.distributed, which the writer and the manager need
_HOME = {"Checkpointer": "checkpointer", "CheckpointManager": "manager", "MARKER": "format", "TrainState": "format",
         "model_fingerprint": "format"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
