"""The rules of fine-tuning that need only the config and the file system: layout, quantization, ZeRO, and that a
local base model exists. Apart from ``lora.py`` (which imports torch) so that the start-up checks answer them
without torch's import (``ddptrain/app/preflight.py``)."""

from __future__ import annotations

from pathlib import Path

from ddptrain.config.choices import Quantize
from ddptrain.config.schema import ModelConfig, ParallelConfig
from ddptrain.errors import ConfigError


def validate_finetune_config(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Cross-key rules of fine-tuning that need no model: layout, quantization, ZeRO."""
    if cfg.pretrained is not None and _local_path(cfg.pretrained) and not Path(cfg.pretrained).is_dir():
        raise ConfigError(f"model.pretrained={cfg.pretrained}: no such model directory; make a small base model "
                          "with: ddptrain +experiment=quickstart hydra.run.dir=outputs/quickstart")
    if cfg.device_map == "auto":
        raise ConfigError("model.device_map=auto would split one model over all GPUs of the node and break data "
                          "parallelism (each rank must hold a whole replica); leave model.device_map=rank")
    if cfg.device_map != "rank":
        raise ConfigError(f"model.device_map={cfg.device_map}: expected rank (the whole model on this rank's device)")
    if cfg.quantize == Quantize.nf4 and not cfg.lora.enabled:
        raise ConfigError("model.quantize=nf4 needs model.lora.enabled=true: 4-bit base weights are frozen, only "
                          "adapters can train")
    if cfg.quantize == Quantize.nf4 and cfg.pretrained is None:
        raise ConfigError("model.quantize=nf4 needs model.pretrained: weights are quantized as they load")
    if cfg.lora.enabled and parallel.zero_stage >= 2:
        raise ConfigError(f"model.lora.enabled=true cannot be combined with parallel.zero_stage={parallel.zero_stage}: "
                          "adapters are small, so shard nothing (0) or the optimizer state (1)")


def _local_path(name: str) -> bool:
    """A file-system path rather than a hub id (``name`` or ``org/name``)."""
    return name.startswith((".", "/", "~")) or len(Path(name).parts) > 2
