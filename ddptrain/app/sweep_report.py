"""The comparison report of ``ddptrain -m``: ``sweep.csv``, ``sweep.md`` and ``sweep.png`` in the sweep dir.

Written by a Hydra callback at the end of any multirun, whichever sweeper and launcher ran it: the jobs' results
are read from the sweep dir (each job wrote ``sweep_job.json`` beside its run), so jobs that ran on a cluster
node count as those that ran here. One row per job: the overrides that differ between jobs, the steady-state
figures of its ``summary.json``, the objective it returned to the sweeper, and its status. A searching sweeper's
result (Optuna's ``optimization_results.yaml``: the best parameters and value) is added below the table.
"""

from __future__ import annotations

import collections
import csv
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ddptrain.app.sweep_job import JobResult, results_in, source_argv
from ddptrain.diagnose.written import written_since

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# summary.json keys in the report, with their headers; a column appears when some job reports it
FIGURES = {
    "tokens_per_s": "tokens/s", "step_time_s": "step (s)", "time_data_s": "data (s)",
    "time_forward_s": "forward (s)", "time_backward_s": "backward (s)", "time_exposed_comm_s": "exposed comm (s)",
    "time_optimizer_s": "optimizer (s)", "overlap_pct": "overlap %", "comm_bytes": "comm bytes/step",
    "max_allocated_gib": "max alloc (GiB)", "rss_gib": "RSS (GiB)", "mfu_pct": "MFU %", "final_loss": "final loss",
}
BREAKDOWN = ["time_data_s", "time_forward_s", "time_backward_s", "time_exposed_comm_s", "time_optimizer_s"]
SEARCH_RESULT = "optimization_results.yaml"  # what Optuna's (and Nevergrad's) sweeper leaves in the sweep dir
INTERNAL = ("hydra.searchpath=", "hydra.job.name=", "hydra.mode=")  # ddptrain's own, not the user's


class Started(NamedTuple):
    """A sweep this process started: its multirun config, and when (``time.time()``: its jobs' results are those
    written since)."""

    config: DictConfig
    at: float


started: list[Started] = []  # each sweep this process started (read by ddptrain -m)


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report``): the report once the sweeper has finished."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        started.append(Started(config, time.time()))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        since = started[-1].at if started else 0.0
        write_report(Path(str(config.hydra.sweep.dir)), command_of(config), since)


def command_of(config: DictConfig) -> str:
    """The ``ddptrain --multirun`` command line that recreates this sweep (as the user gave it)."""
    hydra_overrides = [str(o) for o in config.hydra.overrides.hydra if not str(o).startswith(INTERNAL)]
    task = [str(o) for o in config.hydra.overrides.task]
    return shlex.join(["ddptrain", "--multirun", *source_argv(config.hydra), *hydra_overrides, *task])


def write_report(sweep_dir: Path, command: str, since: float = 0.0) -> list[JobResult]:
    """``sweep.csv``, ``sweep.md`` and ``sweep.png`` for every job that left a result in ``sweep_dir`` since
    ``since`` (the sweep's start)."""
    results = results_in(sweep_dir, since)
    columns, rows = rows_of(results)
    with (sweep_dir / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    shown = [c for c in columns if c != "run_dir"]
    header = [FIGURES.get(c, c) for c in shown]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c], exact=c.startswith("objective")) for c in shown) + " |")
    parts = [f"# Sweep: {sweep_dir}", "", "\n".join(lines), "", *search_result(sweep_dir, since),
             "![tokens/s and step breakdown per job](sweep.png)", "", "Produced by:", "", "```bash", command, "```",
             "", "Figures are steady-state medians from each job's summary.json (first logged window skipped); "
             "each job's run dir holds its metrics.jsonl and config.yaml."]
    (sweep_dir / "sweep.md").write_text("\n".join(parts) + "\n")
    plot(results, varying(results), sweep_dir / "sweep.png")
    return results


def search_result(sweep_dir: Path, since: float = 0.0) -> list[str]:
    """A searching sweeper's best point, as markdown lines (none for a grid, nor for an earlier sweep's search in
    the same sweep dir: one written before ``since``)."""
    path = sweep_dir / SEARCH_RESULT
    if not written_since(path, since):
        return []
    found = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(found, dict)
    if "best_params" not in found:  # several objectives: a Pareto front
        return [f"{found.get('name', 'search')}: {len(found.get('solutions', []))} Pareto-optimal trials "
                f"(see {SEARCH_RESULT})", ""]
    params = ", ".join(f"{k}={v}" for k, v in found["best_params"].items())
    return [f"Best of the {found.get('name', 'search')} search: **{params}** (objective {found['best_value']:.6g})",
            ""]


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
    objective = next((r.objective for r in results if r.objective), "")
    rows = []
    for r in results:
        chosen = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in r.overrides}
        row: dict[str, Any] = {"job": r.num, **{k: chosen.get(k, "") for k in keys}}
        row.update({k: r.summary.get(k) for k in figures})
        if objective:
            row[f"objective: {objective}"] = r.value
        row["status"] = "ok" if r.ok else f"failed: {r.error}"
        row["run_dir"] = str(r.run_dir)
        rows.append(row)
    objective_column = [f"objective: {objective}"] if objective else []
    return ["job", *keys, *figures, *objective_column, "status", "run_dir"], rows


def _cell(value: Any, exact: bool = False) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float) and exact:  # the objective: the digits the sweeper compared
        return f"{value:.6g}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value).replace("|", "/")


def plot(results: list[JobResult], keys: list[str], path: Path) -> None:
    """``figure`` saved as ``path``."""
    figure(results, keys).savefig(path, dpi=110)


def figure(results: list[JobResult], keys: list[str]) -> Figure:
    """Left: tokens/s per job; right: the step-time breakdown per job (failed jobs are left empty).

    Each job's label is its values of the swept keys, one per line, turned upright: side by side, several jobs'
    labels ran into each other. The breakdown's legend stands right of its panel, not over its bars.
    """
    from matplotlib.figure import Figure  # here, not at import: matplotlib costs every command half a second

    labels = ["\n".join(f"{k.split('.')[-1]}={o.partition('=')[2]}" for k in keys
                        for o in r.overrides if o.partition("=")[0].lstrip("+~") == k) or str(r.num)
              for r in results]
    fig = Figure(figsize=(max(9, 1.1 * len(results) + 6), 5), layout="constrained")
    tput, parts = fig.subplots(1, 2)
    xs = list(range(len(results)))
    tput.bar(xs, [r.summary.get("tokens_per_s", 0.0) for r in results], color="#4C72B0")
    bottom = [0.0] * len(results)
    for key in BREAKDOWN:
        heights = [r.summary.get(key, 0.0) or 0.0 for r in results]
        parts.bar(xs, heights, bottom=bottom, label=key.removeprefix("time_").removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for axes, title in ((tput, "global tokens/s"), (parts, "step time breakdown (s)")):
        axes.set_title(title)
        axes.set_xticks(xs, labels, rotation=90, fontsize="small")
    parts.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    for r, x in zip(results, xs, strict=True):
        if not r.ok:
            tput.annotate("failed", (x, 0), ha="center", va="bottom", color="#C44E52")
    return fig
