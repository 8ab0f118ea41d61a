"""The training loop."""

from ddptrain.train.loop import NonFiniteError, Stopped, train

__all__ = ["NonFiniteError", "Stopped", "train"]
