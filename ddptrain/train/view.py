"""What the step observer and the first step's measurements read of the trainer, named as a protocol so that
they need not import ``train/trainer.py`` (which builds them: an import there would make a cycle)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ddptrain.config.choices import Precision
from ddptrain.config.schema import Config
from ddptrain.parallel import Wrapped
from ddptrain.runtime.hooks import StepHooks
from ddptrain.runtime.process_group import DistEnv
from ddptrain.telemetry.memory import ModelStateProbe
from ddptrain.telemetry.metrics import StepMetrics


class TrainerView(Protocol):
    """The trainer's parts the instrumentation reads (``train.trainer.Trainer`` has every one)."""

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    model: torch.nn.Module
    wrapped: Wrapped
    optimizer: torch.optim.Optimizer
    metrics: StepMetrics
    probe: ModelStateProbe
    hooks: StepHooks
    start: int
    n_params: int
    trainable: int
    precision: Precision
