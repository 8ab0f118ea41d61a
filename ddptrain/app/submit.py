"""``sweep.launcher=submitit``: a sweep's jobs submitted at once through submitit's executor (SLURM, or local
processes), each the same ``python -m ddptrain ...`` command a local sweep runs, on one node.

submitit writes the SLURM script, submits it, and keeps each job's logs in ``<sweep dir>/submitit``; ddptrain
only maps ``sweep.*`` to the executor's parameters and waits. The run dirs must be on a filesystem the jobs
share with the submitting host (a cluster's home or scratch): each job's ``summary.json`` is read from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddptrain.config.schema import SweepConfig
from ddptrain.errors import ConfigError


def executor_parameters(cfg: SweepConfig, name: str) -> dict[str, Any]:
    """submitit's ``update_parameters`` for one single-node job that starts its own workers (one task)."""
    params: dict[str, Any] = {"name": name, "timeout_min": cfg.timeout_min, "nodes": 1, "tasks_per_node": 1,
                              "gpus_per_node": cfg.gpus_per_node}
    optional = {"slurm_partition": cfg.partition, "cpus_per_task": cfg.cpus_per_task, "mem_gb": cfg.mem_gb,
                "slurm_additional_parameters": dict(cfg.slurm_additional) or None}
    return params | {k: v for k, v in optional.items() if v is not None}


def submit(commands: list[list[str]], cfg: SweepConfig, folder: Path, env: dict[str, str]) -> list[Any]:
    """Submit every command as its own job; returns submitit's jobs (``job.job_id``, ``job.exception()``)."""
    try:
        import submitit
        from submitit.helpers import CommandFunction
    except ImportError as exc:
        raise ConfigError("sweep.launcher=submitit needs the submitit package: pip install 'ddptrain[submitit]'") \
            from exc
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=None if cfg.cluster == "auto" else str(cfg.cluster))
    except RuntimeError as exc:  # e.g. cluster=slurm where srun is missing
        raise ConfigError(f"sweep.cluster={cfg.cluster}: {exc}") from exc
    executor.update_parameters(**executor_parameters(cfg, f"ddptrain-{folder.parent.name}"))
    cwd = os.getcwd()  # relative paths in the overrides (data files) mean what they mean here
    return [executor.submit(CommandFunction(command, cwd=cwd, env=env)) for command in commands]


def outcome(job: Any) -> tuple[int, list[str]]:
    """Wait for ``job``; its exit status (0, or 1 when it failed) and its error log's lines (the job's own, then
    submitit's traceback, which quotes them again)."""
    failed = job.exception() is not None
    return int(failed), (job.stderr() or "").splitlines()
