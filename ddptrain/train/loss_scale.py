"""fp16 mixed precision's loss scaling (``train.precision=fp16``), for GPUs without bf16 (T4, V100).

torch's ``GradScaler`` (``ShardedGradScaler`` when FSDP2 shards the gradients, ZeRO-2/3, which all-reduces its
inf check over the shards) scales the loss before backward and unscales the gradients before clipping. Its inf
check agrees with the step's non-finite verdict on every rank (the gradients it reads are the synced ones), and
the update is skipped on that verdict on the device (``apply_update``), so an overflow costs no host read. An
overflow (non-finite gradients from a finite loss) is the scaler's normal back-off (the scale halves), counted in
``scaler_backoffs``, not a ``train.nan_policy`` event. A non-finite loss is a policy event (``step/control.py``):
its update is skipped too, and the scale also halves (the scaler cannot tell the two apart on its own), but it
counts in ``skipped_steps``, not as a back-off. The scale and its growth tracker are checkpointed and resume
exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

log = logging.getLogger("ddptrain")


class LossScaler:
    """One run's loss scale: scale, unscale, update; back-offs counted as the ranks agree on them at checks."""

    def __init__(self, device: torch.device, sharded: bool) -> None:
        self.scaler = ShardedGradScaler(device.type) if sharded else GradScaler(device.type)
        self.backoffs = 0  # overflow steps (non-finite gradients from a finite loss), as the checks learned of them

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (before clipping); records the scaler's inf check."""
        self.scaler.unscale_(optimizer)

    def update(self) -> None:
        """After the (skipped or taken) update: halve the scale after an overflow, grow it after a calm stretch."""
        self.scaler.update()

    def count_backoffs(self, overflows: int) -> None:
        """At a check step: the overflows the ranks agreed on since the last check."""
        self.backoffs += overflows

    def window(self) -> dict[str, float]:
        """The current scale and the back-offs so far (sync point: a host read, at logging windows only)."""
        return {"loss_scale": float(self.scaler.get_scale()), "scaler_backoffs": self.backoffs}

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "backoffs": self.backoffs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            log.warning("the checkpoint has no loss scale (not trained in fp16): starting from the initial scale")
            return
        state = dict(state)
        self.backoffs = int(state.pop("backoffs"))
        self.scaler.load_state_dict(state)
