"""The run's stateful parts, registered by key, and when they are checkpointed.

``CheckpointManager`` is given the model and optimizer (saved together, keyed by parameter name) and each other
part by key: ``scheduler`` (the LR schedule), ``data`` (the data position), ``run`` (the batch the run trains
with) and, in fp16, ``grad_scaler``. Each part gives and takes its own ``state_dict``; the checkpointer lays them
out in ``trainer.pt`` and saves every rank's RNG streams beside them. The manager owns the schedule:
``maybe_save(step, last=..., stop=...)`` saves every ``checkpoint.every_n_steps`` steps, after the last step and
when a stop was requested, and the last save and a stop's are committed before it returns (torchtitan's
``CheckpointManager.save(curr_step, last_step=...)`` has the same shape).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ddptrain.checkpoint.checkpointer import Checkpointer
from ddptrain.checkpoint.format import TrainState
from ddptrain.diagnose.whereabouts import WHEREABOUTS

log = logging.getLogger("ddptrain")


class CheckpointManager:
    """Parts are torch's ``Stateful``: ``state_dict()`` and ``load_state_dict(state)``; a part the checkpoint holds
    nothing for is given an empty dict and keeps its initial state (the fp16 scaler resuming an fp32 run)."""

    def __init__(self, checkpointer: Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 parts: dict[str, Stateful], every_n_steps: int) -> None:
        self.checkpointer = checkpointer
        self.model = model
        self.optimizer = optimizer
        self.parts = parts
        self.every_n_steps = every_n_steps  # 0: only the last step's save (and a stop's)

    @property
    def root(self) -> Path:
        return self.checkpointer.root

    def resume(self, target: str | None) -> int:
        """Load the checkpoint ``train.resume`` names (if any) into every part; returns the step to continue
        after (0 for a fresh start)."""
        self.checkpointer.remove_partial()
        self.checkpointer.refuse_overwrite(target)
        path = self.checkpointer.resolve(target)
        if path is None:
            if target == "auto":
                log.info("train.resume=auto: no checkpoint in %s, starting from step 0", self.root)
            return 0
        state = self.checkpointer.load(path, self.model, self.optimizer)
        saved = state.parts()
        for key, part in self.parts.items():
            part.load_state_dict(saved.get(key) or {})
        log.info("resumed from %s at step %d", path, state.step)
        return state.step

    def due(self, step: int, last: bool = False) -> bool:
        """Whether ``step`` is on the schedule: every ``checkpoint.every_n_steps`` steps, and the last."""
        return last or (self.every_n_steps > 0 and step % self.every_n_steps == 0)

    def export(self, run_dir: Path) -> None:
        """The trained model for transformers (``checkpoint.export``): see ``Checkpointer.export``."""
        self.checkpointer.export(self.model, run_dir)

    def maybe_save(self, step: int, *, last: bool = False, stop: bool = False) -> bool:
        """Save after ``step`` if it is due or a stop was requested; the last save and a stop's are committed
        before this returns (an asynchronous save otherwise goes on in the background). True when it saved."""
        if not (stop or self.due(step, last)):
            return False
        WHEREABOUTS.at("save")  # sync point: a save's barriers (all of its write, unless async)
        state = TrainState.from_parts(step, {key: part.state_dict() for key, part in self.parts.items()})
        self.checkpointer.save(state, self.model, self.optimizer, wait=stop or last)
        return True
