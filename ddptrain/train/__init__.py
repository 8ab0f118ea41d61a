"""The training loop (``loop.py``), what it builds once (``components.py``), one step (``step.py``) and what watches
it (``observer.py``)."""

from ddptrain.train.control import NonFiniteError, Stopped
from ddptrain.train.loop import train

__all__ = ["NonFiniteError", "Stopped", "train"]
