"""What a run with replica groups refuses, before any worker starts: one line each, naming the key.

The cross-group average (``ft/replica.py``) runs after torch DDP's all-reduce inside the group, on whole gradients
held by every rank: the ZeRO stages and our own engines keep other states, which a heal would not copy as they are.
The micro batch must be known before the groups start (``auto`` is chosen by the ranks of one job together), and
Ray Train's launch has no group agents.
"""

from __future__ import annotations

from ddptrain.config.choices import Engine, FtSync, Launcher, OptimImpl
from ddptrain.config.schema import AUTO, Config
from ddptrain.errors import ConfigError


def check_replica_groups(cfg: Config) -> None:
    """Refuse what replica groups cannot run with (nothing without replica groups)."""
    ft = cfg.ft
    if ft.replica_groups == 0:
        return
    lead = f"ft.replica_groups={ft.replica_groups}"
    if cfg.parallel.engine != Engine.torch or cfg.parallel.zero_stage != 0:
        raise ConfigError(f"{lead} cannot be combined with parallel.engine={cfg.parallel.engine} and parallel."
                          f"zero_stage={cfg.parallel.zero_stage}: replica groups train torch DDP inside each group "
                          "(parallel.engine=torch parallel.zero_stage=0)")
    if ft.sync != FtSync.ddp and cfg.optim.impl in (OptimImpl.foreach, OptimImpl.for_loop):
        # a non-finite step skips optimizer.step() on these kernels, and DiLoCo counts its window in that step's
        # hooks: one group would fall a step behind the others' window
        raise ConfigError(f"ft.sync={ft.sync} cannot be combined with optim.impl={cfg.optim.impl}: DiLoCo counts "
                          "its window in the optimizer's step, which these kernels skip on a non-finite step "
                          "(use optim.impl=fused or auto)")
    if cfg.data.micro_batch_size == AUTO:
        raise ConfigError(f"{lead} cannot be combined with data.micro_batch_size=auto: set a number (every group "
                          "must split the global batch alike before they meet)")
    if cfg.launch.backend == Launcher.ray:
        raise ConfigError(f"{lead} cannot be combined with launch.backend=ray: use the local launch "
                          "(launch.backend=torchrun) or ddptrain-k8s --replica-groups")
