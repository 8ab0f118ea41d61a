"""Points in a run where something outside training may act: a step's start, loss, update and end, a save's commit.

``StepHooks`` does nothing at each point; the loop and the checkpointer are given an instance and call it,
without knowing what a subclass does there. Fault injection for the reliability tests
(``ddptrain/testing/faults.py``) is the one subclass today.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch


class StepHooks:
    """Every point a no-op: what a run without hooks is given."""

    def step_started(self, step: int, phase: Callable[[str], AbstractContextManager]) -> None:
        """Before step ``step`` reads its data; ``phase`` is the step timer's (time spent here counts in it)."""

    def poisons_loss(self, step: int) -> bool:
        """True when this rank's loss of ``step`` must be made non-finite before its backward."""
        return False

    def overflows_gradients(self, step: int) -> bool:
        """True when this rank's gradients of ``step`` must overflow fp16 from a finite loss."""
        return False

    def update_done(self, step: int, model: torch.nn.Module) -> None:
        """After step ``step``'s update (before its check, if it is a check step); ``model`` as this rank holds it."""

    def step_ended(self, step: int) -> None:
        """After step ``step``'s update and learning-rate step, before its checkpoint."""

    def before_commit(self, step: int) -> None:
        """While the checkpoint of ``step`` is written (or being written in the background) and not committed."""
