"""The trainer (``trainer.py``: its parts, built once, its step and its loop), the pieces of a step (``step.py``)
and what watches it (``observer.py``)."""

from ddptrain.train.control import NonFiniteError, Stopped
from ddptrain.train.trainer import Trainer, train

__all__ = ["NonFiniteError", "Stopped", "Trainer", "train"]
