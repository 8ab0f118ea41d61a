"""One job of ``ddptrain -m``: Hydra's task function, run by whatever launcher the sweep uses.

Hydra composes each job's config and calls :func:`sweep_job` with it: in this process (the ``ddptrain`` and
``basic`` launchers), in a submitit job on a cluster node (``submitit_slurm``, ``submitit_local``) or in a worker
of another launcher. The job itself is a full ``python -m ddptrain`` in its own process with the job's overrides
and run dir, so it starts its own workers (``launch.nproc_per_node``) and a failure, even at start-up, ends that
process and not the sweep. Its result is written beside its run (``sweep_job.json``, read by the report whichever
launcher ran it) and its objective (``sweep.objective``, a ``summary.json`` figure) is returned to the sweeper.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddptrain.config.compose import PRIMARY, config_dir
from ddptrain.diagnose.written import written_since
from ddptrain.errors import flat

RESULT = "sweep_job.json"  # in each job's run dir


class SweepJobFailed(RuntimeError):
    """A sweep job's ``ddptrain`` exited non-zero (its last error line is the message)."""


@dataclass
class JobResult:
    num: int
    overrides: list[str]  # this job's own overrides (the sweep's choices and the fixed ones)
    run_dir: Path
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # the job's last error line, when it failed
    objective: str = ""  # sweep.objective
    value: float | None = None  # its value in summary.json

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and bool(self.summary)

    def save(self) -> None:
        record = {**asdict(self), "run_dir": str(self.run_dir)}
        record.pop("summary")  # summary.json beside it holds it
        tmp = self.run_dir / f".{RESULT}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.run_dir / RESULT)

    @classmethod
    def load(cls, path: Path) -> JobResult:
        record = json.loads(path.read_text())
        result = cls(**{**record, "run_dir": Path(record["run_dir"])})
        return result.with_summary()

    def with_summary(self) -> JobResult:
        summary_path = self.run_dir / "summary.json"
        if self.exit_code == 0 and summary_path.is_file():
            self.summary = json.loads(summary_path.read_text())
        return self


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DDPTRAIN_RUN_DIR", None)  # each job gets its own run dir through hydra.run.dir
    return env


def job_command(argv: list[str], overrides: list[str], run_dir: Path) -> list[str]:
    """The ``python -m ddptrain`` command of one job: it starts its own workers and writes to ``run_dir``."""
    return [sys.executable, "-m", "ddptrain", *argv, *overrides, f"hydra.run.dir={run_dir}"]


def run_job(num: int, argv: list[str], overrides: list[str], run_dir: Path, env: dict[str, str]) -> JobResult:
    """One ``python -m ddptrain`` with its own workers; its output passes through, its last error line is kept."""
    tail: collections.deque[str] = collections.deque(maxlen=20)
    with subprocess.Popen(job_command(argv, overrides, run_dir), env=env, stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())
    return job_result(num, overrides, run_dir, proc.returncode, list(tail))


def job_result(num: int, overrides: list[str], run_dir: Path, exit_code: int, tail: list[str]) -> JobResult:
    """A finished job: its ``summary.json`` when it succeeded, else its last ``ddptrain:`` error line."""
    result = JobResult(num, overrides, run_dir, exit_code).with_summary()
    errors = [line for line in tail if line.startswith("ddptrain:")] or tail[-1:]
    if not result.summary:
        result.error = flat(errors[-1] if errors else f"exit code {exit_code}", 240)
    return result


def source_argv(hydra_cfg: DictConfig) -> list[str]:
    """``--config-dir``/``--config-name`` that recompose this job in its own ``ddptrain``: the sweep's primary
    directory when it is a user's, and the primary config's name."""
    main = next((s for s in hydra_cfg.runtime.config_sources if s.provider == "main"), None)
    argv = []
    if main is not None and main.schema == "file" and Path(main.path) != config_dir():
        argv += ["--config-dir", str(main.path)]
    name = str(hydra_cfg.job.config_name).removeprefix("ddptrain_primary_")
    return [*argv, *(["--config-name", name] if name != PRIMARY else [])]


def sweep_job(cfg: DictConfig) -> float | None:
    """Hydra's task function: run this job's ``ddptrain``; return its objective (None when the run reported
    none), or raise :class:`SweepJobFailed` so the sweeper sees the failure."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    given = list(overrides)
    group = f"sweep-{Path(hydra_cfg.sweep.dir).parent.name}-{Path(hydra_cfg.sweep.dir).name}"
    if not any(o.split("=")[0].lstrip("+~") == "logger.wandb.group" for o in overrides):
        given.append(f"logger.wandb.group={group}")  # the sweep's jobs side by side in W&B
    num = int(hydra_cfg.job.num)
    result = run_job(num, source_argv(hydra_cfg), given, run_dir, job_env())
    result.overrides = overrides
    result.objective = str(cfg.sweep.objective)
    value = result.summary.get(result.objective)
    result.value = float(value) if isinstance(value, int | float) else None
    result.save()
    if not result.ok:
        raise SweepJobFailed(result.error)
    return result.value


def results_in(sweep_dir: Path, since: float = 0.0) -> list[JobResult]:
    """Every job result written under ``sweep_dir`` at or after ``since`` (the sweep's start, ``time.time()``), by
    job number. A sweep dir used again (``checkpoint.overwrite=true``) keeps the results of the earlier sweep's
    jobs, and one with more jobs left some this sweep never ran: read with them, the report and the command's
    line listed those as this sweep's."""
    found = [JobResult.load(p) for p in sweep_dir.rglob(RESULT) if written_since(p, since)]
    return sorted(found, key=lambda r: r.num)

