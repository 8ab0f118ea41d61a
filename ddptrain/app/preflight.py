"""The preflight: start-up checks that need more than the config (the world size, devices, files), on every rank.

They need the data, model, kernel and telemetry packages, so they live in the app, above them all; checks that
need only the config live beside the schema (``ddptrain/config/schema.py``). Every failure is a
ConfigError whose one-line message names the key and what was expected.

Only the questions about devices import torch, when a key asks them (``parallel.cpu_offload``,
``parallel.kernels=triton``, ``data.micro_batch_size=auto``): the launcher answers a wrong batch size or a missing
file without the second or more torch's import costs (``tests/test_startup.py``).
"""

from __future__ import annotations

from ddptrain.config.choices import Kernels
from ddptrain.config.schema import AUTO, AUTO_NEEDS_MEMORY, Config
from ddptrain.data import BatchShape, validate_source
from ddptrain.errors import ConfigError
from ddptrain.ft.checks import check_replica_groups
from ddptrain.models.finetune_rules import validate_finetune_config
from ddptrain.telemetry.baseline import load_baseline


def validate_config(cfg: Config, world_size: int) -> BatchShape | None:
    """Check what the schema cannot (devices, files, the world size); returns the batch shape (None while
    ``data.micro_batch_size=auto`` is still to be chosen)."""
    validate_finetune_config(cfg.model, cfg.parallel)
    check_replica_groups(cfg)
    validate_source(cfg.data)
    if cfg.parallel.cpu_offload and not cuda_available():
        raise ConfigError("parallel.cpu_offload=true needs CUDA devices: it keeps FSDP2's state on the CPU and "
                          "computes on the GPU")
    if cfg.parallel.kernels == Kernels.triton:  # the one choice the kernels' check can refuse (auto falls back)
        from ddptrain.kernels import check_kernels

        check_kernels(cfg.parallel.kernels, "cuda" if cuda_available() else "cpu")
    load_baseline(cfg.metrics.baseline)
    if cfg.data.micro_batch_size == AUTO:  # chosen later, once the device is known; its memory must be known
        if cfg.plan.device_memory_gib is None and not cuda_available():
            raise ConfigError(AUTO_NEEDS_MEMORY)
        if cfg.data.global_batch_size % world_size:
            raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by "
                              f"dp={world_size}: data.micro_batch_size=auto needs a whole number of sequences per rank")
        if not cuda_available():  # the device is this CPU with plan.device_memory_gib: known before any
            from ddptrain.plan.memory.auto_batch import refuse_unfittable_state  # worker starts (a GPU's, after)
            from ddptrain.plan.memory.planner import target_device

            refuse_unfittable_state(cfg, world_size, target_device("cpu", cfg.plan.device_memory_gib, None))
        return None
    return BatchShape.from_config(cfg, world_size)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
