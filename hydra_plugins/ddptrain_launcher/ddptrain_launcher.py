"""``hydra/launcher=ddptrain``: a sweep's jobs one after another on this machine, each in its own process.

Hydra only loads launcher plugins from the ``hydra_plugins`` package, so this one lives here (and without
``from __future__ import annotations``: Hydra executes plugin modules outside ``sys.modules`` while it scans them,
where a dataclass with string annotations cannot be built). Like Hydra's basic
launcher it runs each job through ``hydra.core.utils.run_job`` (the job's config, run dir, ``.hydra/`` files,
callbacks and job logging are Hydra's: ``hydra.job_logging`` is applied for the job, which by Hydra's default
writes ``<job name>.log`` in the job's dir, and the sweep's own ``hydra.hydra_logging`` is put back after it);
ddptrain's task function then starts the job as its own ``python -m ddptrain``, so a job can start its own workers
on the devices the jobs share (ddptrain's primary config sets ``hydra/job_logging=none``: that process logs for
itself, to ``train.log``). Unlike the basic launcher a failed job does not stop the batch: every job of the batch
runs and its failure is reported, unless ``fail_fast`` (``ddptrain -m --fail-fast``) stops at the first. The
sweeper then sees each job's return, failed ones included. Hydra's launcher conformance suites run against it
(``tests/test_hydra_launcher.py``).
"""


import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from ddptrain.errors import say


@dataclass
class DdptrainLauncherConf:
    _target_: str = "hydra_plugins.ddptrain_launcher.ddptrain_launcher.DdptrainLauncher"
    fail_fast: bool = False  # stop at the first failed job (the jobs after it are not run)


ConfigStore.instance().store(group="hydra/launcher", name="ddptrain", node=DdptrainLauncherConf, provider="ddptrain")


class DdptrainLauncher(Launcher):
    def __init__(self, fail_fast: bool = False) -> None:
        self.fail_fast = fail_fast
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        returns: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
                sweep_config.hydra.job.num = idx
            run_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
            say(f"ddptrain: sweep job {idx}: {shlex.join(filter_overrides(overrides))} -> {run_dir}")
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)  # the sweep's, after the job's
            returns.append(ret)
            if ret.status == JobStatus.FAILED:
                # the task function's exception (its one-line message); return_value would raise it
                say(f"ddptrain: sweep job {idx} failed: {ret._return_value}")
                if self.fail_fast:
                    break
        return returns
