"""What the trainer's build (``train/trainer.py``) uses beside the parts it builds: which checkpoint a run resumes
from, the batch shape every checkpoint records, and autocast in the run's precision."""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext

import torch

from ddptrain.config.choices import Precision
from ddptrain.data import BatchShape

log = logging.getLogger("ddptrain")


def resume_target(configured: str | None) -> str | None:
    """``train.resume``, except that a worker restarted by the elastic agent always continues (auto)."""
    if configured is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        log.warning("restarted by the elastic agent (or Ray Train): resuming from the latest checkpoint "
                    "(train.resume=auto)")
        return "auto"
    return configured


class RunShape:
    """The batch a run trains with, recorded in every checkpoint; a resumed run says what changed since."""

    def __init__(self, shape: BatchShape, zero_stage: int) -> None:
        self.shape = shape
        self.zero_stage = zero_stage

    def state_dict(self) -> dict[str, int]:
        return {"world_size": self.shape.dp, "global_batch_size": self.shape.global_batch_size,
                "zero_stage": self.zero_stage}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        shape = self.shape
        if saved["world_size"] != shape.dp:
            log.warning("resuming on %d ranks from a checkpoint of %d: grad_accum %d keeps the global batch of %d",
                        shape.dp, saved["world_size"], shape.grad_accum, shape.global_batch_size)
        if saved["global_batch_size"] != shape.global_batch_size:
            log.warning("the checkpoint trained with a global batch of %d; continuing with %d",
                        saved["global_batch_size"], shape.global_batch_size)


def autocast_context(precision: Precision, device: torch.device) -> AbstractContextManager:
    """Autocast in the resolved precision (``runtime.device_precision``): bf16, fp16 (with a loss scaler,
    ``train/loss_scale.py``) or none for fp32."""
    if precision == Precision.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    if precision == Precision.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
