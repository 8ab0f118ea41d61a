"""``ddptrain -m``: Hydra's sweep syntax expanded into jobs, each a full launch, then one comparison report.

Jobs run one after another (they would compete for the same devices otherwise), each as its own
``python -m ddptrain ...`` in ``<sweep dir>/<job number>`` (Hydra's multirun layout), so a job that fails,
even at composition, is reported and the sweep goes on (``--fail-fast`` stops it). With
``sweep.launcher=submitit`` the same commands are submitted all at once as cluster jobs (``ddptrain.app.submit``).
At the end the sweep dir holds ``sweep.csv``, ``sweep.md`` and ``sweep.png``: one row per job with its
overrides and the steady-state figures of its ``summary.json``.
"""

from __future__ import annotations

import collections
import csv
import itertools
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

from ddptrain.config.choices import SweepLauncher
from ddptrain.config.compose import Source
from ddptrain.config.schema import SweepConfig
from ddptrain.errors import ConfigError, flat, one_line, say

# summary.json keys in the report, with their headers; a column appears when some job reports it
FIGURES = {
    "tokens_per_s": "tokens/s", "step_time_s": "step (s)", "time_data_s": "data (s)",
    "time_forward_s": "forward (s)", "time_backward_s": "backward (s)", "time_exposed_comm_s": "exposed comm (s)",
    "time_optimizer_s": "optimizer (s)", "overlap_pct": "overlap %", "comm_bytes": "comm bytes/step",
    "max_allocated_gib": "max alloc (GiB)", "rss_gib": "RSS (GiB)", "mfu_pct": "MFU %", "final_loss": "final loss",
}
BREAKDOWN = ["time_data_s", "time_forward_s", "time_backward_s", "time_exposed_comm_s", "time_optimizer_s"]


@dataclass
class JobResult:
    num: int
    overrides: list[str]  # this job's own overrides (the sweep's choices and the fixed ones)
    run_dir: Path
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # the job's last error line, when it failed

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and bool(self.summary)


def expand(overrides: list[str], params: dict[str, str] | None) -> list[list[str]]:
    """Every job's overrides: the cartesian product of the sweeps (``a=1,2``, ``range()``, ``choice()``).

    ``hydra.sweeper.params`` (e.g. from an experiment) sweeps too; the command line wins for the same key.
    """
    parser = OverridesParser.create()
    given = parser.parse_overrides(overrides)
    keys = {o.get_key_element().lstrip("+~") for o in given}
    from_config = [f"{k}={v}" for k, v in (params or {}).items() if k.lstrip("+~") not in keys]
    parsed = parser.parse_overrides(from_config) + given
    if any(o.is_hydra_override() and o.is_sweep_override() for o in parsed):
        raise ConfigError("--multirun: sweeping over hydra.* keys is not supported")
    choices: dict[str, list[str]] = {}  # key -> its override per job (a later one of the same key wins, in place)
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise ConfigError(f"--multirun: {key}: only lists, range() and choice() can be swept, not intervals")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]
    jobs = [list(job) for job in itertools.product(*choices.values())]
    return [[o for o in job if not o.startswith("hydra.sweep.")] for job in jobs]  # the sweep's, not the job's


def job_command(argv: list[str], overrides: list[str], run_dir: Path) -> list[str]:
    """The ``python -m ddptrain`` command of one job: it starts its own workers and writes to ``run_dir``."""
    return [sys.executable, "-m", "ddptrain", *argv, *overrides, f"hydra.run.dir={run_dir}"]


def run_job(num: int, argv: list[str], overrides: list[str], run_dir: Path, env: dict[str, str]) -> JobResult:
    """One ``python -m ddptrain`` with its own workers; output passes through, its last error line is kept."""
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
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if exit_code == 0 and summary_path.is_file() else {}
    errors = [line for line in tail if line.startswith("ddptrain:")] or tail[-1:]
    error = "" if summary else flat(errors[-1] if errors else f"exit code {exit_code}", 240)
    return JobResult(num, overrides, run_dir, exit_code, summary, error)


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DDPTRAIN_RUN_DIR", None)  # each job gets its own run dir through hydra.run.dir
    return env


def run_sweep(source: Source, cfg: DictConfig, fail_fast: bool = False) -> int:
    """Run every job of the sweep, then write the report; non-zero when some job failed."""
    if "LOCAL_RANK" in os.environ:
        raise ConfigError("--multirun launches the workers of each job itself: run it without torchrun")
    try:
        node = cfg.hydra.sweeper.get("params")
        params = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        jobs = expand(source.overrides, params)  # type: ignore[arg-type]
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    sweep_dir = Path(cfg.hydra.sweep.dir).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    group = f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
    argv = Source(source.user_dir, source.name).argv()
    # each job's overrides, plus the sweep's W&B group unless the job names one
    given = [job if any(o.split("=")[0].lstrip("+~") == "logger.wandb.group" for o in job)
             else [*job, f"logger.wandb.group={group}"] for job in jobs]
    if cfg.sweep.launcher == SweepLauncher.submitit:
        if fail_fast:
            raise ConfigError("--fail-fast stops a sweep whose jobs run one after another: it cannot be combined "
                              "with sweep.launcher=submitit, which submits them all at once")
        results = _submit_all(jobs, given, argv, sweep_dir, cfg)
    else:
        results = _run_each(jobs, given, argv, sweep_dir, fail_fast)
    command = shlex.join(["ddptrain", "--multirun", *argv, *source.overrides])
    write_report(results, sweep_dir, command, len(jobs))
    failed = [r.num for r in results if not r.ok]
    say(f"ddptrain: sweep of {len(jobs)} jobs in {sweep_dir}: {len(results) - len(failed)} succeeded"
        + (f", failed: {', '.join(map(str, failed))}" if failed else "") + "; see sweep.md, sweep.csv, sweep.png")
    return 1 if failed else 0


def _run_each(
    jobs: list[list[str]], given: list[list[str]], argv: list[str], sweep_dir: Path, fail_fast: bool
) -> list[JobResult]:
    """Every job on this machine, one after another (they would compete for the same devices otherwise)."""
    results = []
    for num, overrides in enumerate(jobs):
        run_dir = sweep_dir / str(num)
        say(f"ddptrain: sweep job {num + 1}/{len(jobs)}: {shlex.join(overrides)} -> {run_dir}")
        result = run_job(num, argv, given[num], run_dir, job_env())
        result.overrides = overrides
        results.append(result)
        if not result.ok:
            say(f"ddptrain: sweep job {num} failed: {result.error}")
            if fail_fast:
                break
    return results


def _submit_all(
    jobs: list[list[str]], given: list[list[str]], argv: list[str], sweep_dir: Path, cfg: DictConfig
) -> list[JobResult]:
    """Every job submitted at once through submitit; their results once all have finished."""
    from ddptrain.app.submit import outcome, submit

    settings = OmegaConf.to_object(cfg.sweep)
    assert isinstance(settings, SweepConfig)
    commands = [job_command(argv, overrides, sweep_dir / str(num)) for num, overrides in enumerate(given)]
    submitted = submit(commands, settings, sweep_dir / "submitit", job_env())
    for num, (overrides, job) in enumerate(zip(jobs, submitted, strict=True)):
        say(f"ddptrain: sweep job {num + 1}/{len(jobs)} submitted as job {job.job_id}: {shlex.join(overrides)} "
            f"-> {sweep_dir / str(num)}")
    say(f"ddptrain: waiting for {len(jobs)} jobs; their logs are in {sweep_dir / 'submitit'}")
    results = []
    for num, (overrides, job) in enumerate(zip(jobs, submitted, strict=True)):
        result = job_result(num, overrides, sweep_dir / str(num), *outcome(job))
        if not result.ok:
            say(f"ddptrain: sweep job {num} failed: {result.error}")
        results.append(result)
    return results


def varying(results: list[JobResult]) -> list[str]:
    """The override keys whose value differs between jobs: what the sweep compares."""
    values: dict[str, set[str]] = collections.defaultdict(set)
    for r in results:
        for o in r.overrides:
            key, _, value = o.partition("=")
            values[key.lstrip("+~")].add(value)
    keys = [k for k, v in values.items() if len(v) > 1 or len({len(r.overrides) for r in results}) > 1]
    return keys or list(values)[:1]


def rows_of(results: list[JobResult]) -> tuple[list[str], list[dict[str, Any]]]:
    keys = varying(results)
    figures = [k for k in FIGURES if any(k in r.summary for r in results)]
    rows = []
    for r in results:
        chosen = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in r.overrides}
        row: dict[str, Any] = {"job": r.num, **{k: chosen.get(k, "") for k in keys}}
        row.update({k: r.summary.get(k) for k in figures})
        row["status"] = "ok" if r.ok else f"failed: {r.error}"
        row["run_dir"] = str(r.run_dir)
        rows.append(row)
    return ["job", *keys, *figures, "status", "run_dir"], rows


def write_report(results: list[JobResult], sweep_dir: Path, command: str, planned: int) -> None:
    columns, rows = rows_of(results)
    with (sweep_dir / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    shown = [c for c in columns if c != "run_dir"]
    header = [FIGURES.get(c, c) for c in shown]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in shown) + " |")
    parts = [f"# Sweep: {sweep_dir}", "", "\n".join(lines), "", "![tokens/s and step breakdown per job](sweep.png)",
             "", "Produced by:", "", "```bash", command, "```", "",
             "Figures are steady-state medians from each job's summary.json (first logged window skipped); "
             "each job's run dir holds its metrics.jsonl and config.yaml."]
    if len(results) < planned:
        parts += ["", f"Stopped after {len(results)} of {planned} jobs (--fail-fast)."]
    (sweep_dir / "sweep.md").write_text("\n".join(parts) + "\n")
    plot(results, varying(results), sweep_dir / "sweep.png")


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value).replace("|", "/")


def plot(results: list[JobResult], keys: list[str], path: Path) -> None:
    """Left: tokens/s per job; right: the step-time breakdown per job (failed jobs are left empty)."""
    labels = ["\n".join(f"{k.split('.')[-1]}={o.partition('=')[2]}" for k in keys
                        for o in r.overrides if o.partition("=")[0].lstrip("+~") == k) or str(r.num)
              for r in results]
    fig = Figure(figsize=(max(8, 1.6 * len(results) + 4), 4.5))
    tput, parts = fig.subplots(1, 2)
    xs = range(len(results))
    tput.bar(xs, [r.summary.get("tokens_per_s", 0.0) for r in results], color="#4C72B0")
    tput.set(title="global tokens/s", xticks=list(xs), xticklabels=labels)
    bottom = [0.0] * len(results)
    for key in BREAKDOWN:
        heights = [r.summary.get(key, 0.0) or 0.0 for r in results]
        parts.bar(xs, heights, bottom=bottom, label=key.removeprefix("time_").removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    parts.set(title="step time breakdown (s)", xticks=list(xs), xticklabels=labels)
    parts.legend(fontsize="small")
    for r, x in zip(results, xs, strict=True):
        if not r.ok:
            tput.annotate("failed", (x, 0), ha="center", va="bottom", color="#C44E52")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
