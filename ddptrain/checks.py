"""Start-up checks of the whole config, run on every rank before any process group exists.

Each config group's package owns its checks; cross-group rules live here. Every failure is a ConfigError
whose one-line message names the key and what was expected.
"""

from __future__ import annotations

import torch

from ddptrain.config import Config
from ddptrain.data import BatchPlan, validate_source
from ddptrain.errors import ConfigError
from ddptrain.models import validate_model_config
from ddptrain.optim import validate_optim_config
from ddptrain.parallel import validate_parallel_config
from ddptrain.parallel.compile import validate_compile
from ddptrain.telemetry.metrics import load_baseline
from ddptrain.telemetry.profile import validate_profile_config
from ddptrain.train.control import validate_nan_policy

PRECISIONS = ("auto", "fp32", "bf16")


def validate_config(cfg: Config, world_size: int) -> BatchPlan:
    """Check everything that can be checked without data or devices; returns the batch plan."""
    for key in ("steps", "log_every", "eval_batches"):
        if getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key}={getattr(cfg.train, key)}: expected a positive integer")
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every}: expected >= 0 (0 disables evaluation)")
    if cfg.train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision={cfg.train.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if cfg.launch.nproc_per_node < 1 or cfg.launch.max_restarts < 0:
        raise ConfigError("launch.nproc_per_node must be >= 1 and launch.max_restarts >= 0")
    if cfg.dist.timeout_s <= 0:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s}: expected a positive number of seconds")
    if cfg.checkpoint.every_n_steps < 0 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.every_n_steps must be >= 0 and checkpoint.keep_last >= 1")
    validate_source(cfg.data)
    validate_model_config(cfg.model, cfg.data.seq_len)
    validate_optim_config(cfg.optim, cfg.train.steps)
    validate_parallel_config(cfg.parallel)
    validate_compile(cfg)
    if cfg.parallel.cpu_offload and not torch.cuda.is_available():
        raise ConfigError("parallel.cpu_offload=true needs CUDA devices: it keeps FSDP2's state on the CPU and "
                          "computes on the GPU")
    validate_profile_config(cfg.profile, cfg.train.steps)
    validate_nan_policy(cfg.train.nan_policy)
    if cfg.launch.stop_grace_s <= 0:
        raise ConfigError(f"launch.stop_grace_s={cfg.launch.stop_grace_s}: expected a positive number of seconds")
    if cfg.metrics.sample_every < 1:
        raise ConfigError(f"metrics.sample_every={cfg.metrics.sample_every}: expected a positive number of steps")
    load_baseline(cfg.metrics.baseline)
    return BatchPlan.derive(
        cfg.data.global_batch_size, cfg.data.micro_batch_size, cfg.data.grad_accum, world_size, cfg.data.seq_len
    )
