"""The training loop."""

from ddptrain.train.loop import train

__all__ = ["train"]
