"""The training loop (``loop.py``), what it builds once (``components.py``), what each step computes (``step.py``)."""

from ddptrain.train.control import NonFiniteError, Stopped
from ddptrain.train.loop import train

__all__ = ["NonFiniteError", "Stopped", "train"]
