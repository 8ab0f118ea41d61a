"""``ddptrain -m`` through Hydra's sweeper and launcher plugins: grids on the basic sweeper, an Optuna search, the
submitit launcher, ddptrain's own launcher (failed jobs reported, ``--fail-fast``), the report as a callback.

The fast tests run the real multirun in this process (Hydra's sweepers, our launcher and callback) with each job's
``ddptrain`` replaced by a stand-in that writes a summary.json from its overrides; the slow ones train for real.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import yaml

from ddptrain.app import sweep_job
from ddptrain.app.cli import run_cli
from ddptrain.app.sweep import installed
from tests.helpers import stub_job
from tests.helpers.cli import run_cli as run_command
from tests.helpers.run_cache import RunCache
from tests.helpers.tiny import TINY_RUN_ARGS as TINY
from tests.helpers.tiny import without


@pytest.fixture
def stub_jobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """Each sweep job's command replaced by the stand-in; the overrides of every job started, in order."""
    started: list[list[str]] = []

    def command(argv: list[str], overrides: list[str], run_dir: Path) -> list[str]:
        started.append(list(overrides))
        return [sys.executable, stub_job.__file__, json.dumps(overrides), str(run_dir)]

    monkeypatch.setattr(sweep_job, "job_command", command)
    monkeypatch.chdir(tmp_path)
    return started


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((sweep_dir / "sweep.csv").open()))


def test_a_grid_runs_the_cartesian_product_with_the_experiments_params_one_job_each(
    stub_jobs: list[list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # bucket_sweep's hydra.sweeper.params sweeps parallel.bucket_cap_mb (1,5,25); the command line adds a key
    assert run_cli(["-m", "+experiment=bucket_sweep", "data.micro_batch_size=2,4", "hydra.sweep.dir=sweep"]) == 0
    chosen = [{o.split("=")[0]: o.split("=")[1] for o in job} for job in stub_jobs]
    assert sorted((c["parallel.bucket_cap_mb"], c["data.micro_batch_size"]) for c in chosen) == sorted(
        (b, m) for b in ("1", "5", "25") for m in ("2", "4"))
    assert all(any(o.startswith("logger.wandb.group=sweep-") for o in job) for job in stub_jobs)  # side by side
    rows = _rows(tmp_path / "sweep")
    assert [r["job"] for r in rows] == [str(n) for n in range(6)] and {r["status"] for r in rows} == {"ok"}
    assert {"parallel.bucket_cap_mb", "data.micro_batch_size", "tokens_per_s", "objective: final_val_loss"} <= set(
        rows[0])
    for row in rows:
        assert float(row["tokens_per_s"]) == 1000.0 * int(row["data.micro_batch_size"])
        assert (tmp_path / "sweep" / row["job"] / "summary.json").is_file()
    md = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "ddptrain --multirun hydra.sweep.dir=sweep +experiment=bucket_sweep data.micro_batch_size=2,4\n" in md
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 5_000
    assert "sweep of 6 jobs in sweep: 6 succeeded" in capsys.readouterr().err


def test_a_failed_job_is_reported_and_the_sweep_goes_on_unless_fail_fast(
    stub_jobs: list[list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # the stand-in fails micro batch 3: two of the four jobs
    assert run_cli(["-m", "data.micro_batch_size=3,2", "optim.lr=0.001,0.01", "hydra.sweep.dir=all"]) == 1
    err = capsys.readouterr().err
    assert ("ddptrain: sweep job 0 failed: ddptrain: error: data.global_batch_size=2 is not divisible by "
            "data.micro_batch_size=3") in err
    assert len(stub_jobs) == 4 and "sweep of 4 jobs in all: 2 succeeded, failed: 0, 1; see sweep.md" in err
    # written though Hydra stopped
    assert [r["status"][:6] for r in _rows(tmp_path / "all")] == ["failed", "failed", "ok", "ok"]

    stub_jobs.clear()
    assert run_cli(["-m", "--fail-fast", "data.micro_batch_size=3,2", "hydra.sweep.dir=first"]) == 1
    assert len(stub_jobs) == 1 and [r["status"][:6] for r in _rows(tmp_path / "first")] == ["failed"]


def test_a_sweep_dir_used_again_reports_only_this_sweeps_jobs(
    stub_jobs: list[list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A search of 4 jobs, then a grid of 2 in the same sweep dir (``checkpoint.overwrite=true``, as a user
    starting over): the report, sweep.csv and the command's line list the grid's 2 jobs, not the earlier sweep's
    jobs 2 and 3, whose results are still there, nor the earlier search's best point. Before, both sweeps' jobs
    were read: "sweep of 4 jobs ... 4 succeeded" for a sweep that ran 2."""
    from ddptrain.app.sweep_report import SEARCH_RESULT

    assert run_cli(["-m", "optim.lr=0.001,0.002,0.003,0.004", "hydra.sweep.dir=sweep"]) == 0
    earlier = tmp_path / "sweep" / SEARCH_RESULT  # as a searching sweeper leaves it
    earlier.write_text("best_params: {optim.lr: 0.003}\nbest_value: 2.5\n")
    capsys.readouterr()
    stub_jobs.clear()
    assert run_cli(["-m", "optim.lr=0.01,0.02", "checkpoint.overwrite=true", "hydra.sweep.dir=sweep"]) == 0
    assert len(stub_jobs) == 2 and (tmp_path / "sweep" / "3" / sweep_job.RESULT).is_file()  # the earlier job's
    rows = _rows(tmp_path / "sweep")
    assert [(r["job"], r["optim.lr"]) for r in rows] == [("0", "0.01"), ("1", "0.02")], rows
    assert "sweep of 2 jobs in sweep: 2 succeeded" in capsys.readouterr().err
    md = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "Best of the" not in md and "0.004" not in md
    # a sweep that stops at a failed job writes its report itself (the sweeper's end never comes): the same rule
    assert run_cli(["-m", "--fail-fast", "data.micro_batch_size=3,2", "checkpoint.overwrite=true",
                    "hydra.sweep.dir=sweep"]) == 1
    assert [r["status"][:6] for r in _rows(tmp_path / "sweep")] == ["failed"]
    assert "sweep of 1 jobs in sweep: 0 succeeded, failed: 0" in capsys.readouterr().err


def test_the_report_is_a_markdown_table_a_csv_with_each_run_dir_and_a_figure_labelled_by_the_swept_values(
        tmp_path: Path) -> None:
    """``write_report`` on three saved job results (in-process, no sweep run): sweep.md's table has a header, a
    separator of one ``---`` per column and a row per job, every line a ``| … |`` row; sweep.csv gives each job's
    own run dir; the figure's bars are the report's blue and each job is labelled ``key=value``; a searching
    sweeper's result names its search (``search`` where it gives no name), or its Pareto front."""
    from matplotlib.colors import to_rgba

    from ddptrain.app.sweep_report import SEARCH_RESULT, figure, search_result, write_report

    sweep_dir = tmp_path / "sweep"
    results = []
    for num, lr in enumerate(("0.001", "0.003", "0.01")):
        run_dir = sweep_dir / str(num)
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"tokens_per_s": 1000.0 * (num + 1)}))
        result = sweep_job.JobResult(num, [f"optim.lr={lr}"], run_dir, 0 if num != 1 else 1, error="boom")
        result.save()
        results.append(result.with_summary())
    write_report(sweep_dir, "ddptrain -m optim.lr=0.001,0.003,0.01")
    table = [line for line in (sweep_dir / "sweep.md").read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:2] == ["job", "optim.lr"] and len(table) == 2 + 3
    assert table[1] == "|" + "---|" * len(header)
    assert all(line.startswith("| ") and line.endswith(" |") for line in table[:1] + table[2:])
    assert [r["run_dir"] for r in _rows(sweep_dir)] == [str(sweep_dir / str(n)) for n in range(3)]
    fig = figure(results, ["optim.lr"])
    tput = fig.axes[0]
    assert [label.get_text() for label in tput.get_xticklabels()] == ["lr=0.001", "lr=0.003", "lr=0.01"]
    assert {patch.get_facecolor() for patch in tput.patches} == {to_rgba("#4C72B0")}
    assert search_result(sweep_dir) == []  # a grid: no search result
    (sweep_dir / SEARCH_RESULT).write_text("best_params: {optim.lr: 0.003}\nbest_value: 2.5\n")
    assert search_result(sweep_dir)[0] == "Best of the search search: **optim.lr=0.003** (objective 2.5)"
    (sweep_dir / SEARCH_RESULT).write_text("name: lr_search\nbest_params: {optim.lr: 0.003}\nbest_value: 2.5\n")
    assert search_result(sweep_dir)[0].startswith("Best of the lr_search search: ")
    (sweep_dir / SEARCH_RESULT).write_text("solutions: [{}, {}]\n")
    assert search_result(sweep_dir) == [f"search: 2 Pareto-optimal trials (see {SEARCH_RESULT})", ""]


def test_the_report_shows_objectives_to_the_digits_the_sweeper_compared(
    stub_jobs: list[list[str]], tmp_path: Path,
) -> None:
    """Two objectives that differ in the fourth digit (2.12360 and 2.12382 from the stand-in's formula) stay
    apart in sweep.md; to three digits both would read 2.12."""
    assert run_cli(["-m", "optim.lr=0.0114815,0.0114842", "hydra.sweep.dir=close"]) == 0
    values = [float(r["objective: final_val_loss"]) for r in _rows(tmp_path / "close")]
    cells = [f"{v:.6g}" for v in values]
    assert f"{values[0]:.3g}" == f"{values[1]:.3g}" and cells[0] != cells[1]
    md = (tmp_path / "close" / "sweep.md").read_text()
    assert all(f"| {cell} |" in md for cell in cells), md


def test_an_optuna_search_gets_each_jobs_objective_and_the_report_names_the_best_point(
    stub_jobs: list[list[str]], tmp_path: Path,
) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.seed=0",
            "optim.lr=interval(1e-4,1e-2)", "hydra.sweep.dir=search"]
    assert run_cli(args) == 0
    rows = _rows(tmp_path / "search")
    assert len(rows) == 4 == len(stub_jobs)
    lrs = [float(r["optim.lr"]) for r in rows]
    assert len(set(lrs)) == 4 and all(1e-4 <= lr <= 1e-2 for lr in lrs)  # sampled from the interval
    values = [float(r["objective: final_val_loss"]) for r in rows]
    best = yaml.safe_load((tmp_path / "search" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(values))  # the sweeper got the objective each job returned
    assert best["best_params"]["optim.lr"] == pytest.approx(lrs[values.index(min(values))])
    assert f"Best of the optuna search: **optim.lr={best['best_params']['optim.lr']}**" in (
        tmp_path / "search" / "sweep.md").read_text()


@pytest.mark.parametrize("terminal", [False, True])
def test_optuna_lines_carry_colour_escapes_only_on_a_terminal(
    terminal: bool, stub_jobs: list[list[str]], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """Optuna's colorlog formatter wrote ANSI escapes into a log that is not a terminal (CI, a file, a pipe)."""
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import io
    import logging
    import os

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    console = io.StringIO()
    monkeypatch.setattr(console, "isatty", lambda: terminal)
    monkeypatch.setattr(sys, "stderr", console)
    handler = logging.StreamHandler(console)
    handler.setFormatter(optuna.logging.create_default_formatter())  # Optuna's own handler's formatter
    library = logging.getLogger("optuna")
    library.addHandler(handler)
    try:
        assert run_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0",
                        "optim.lr=interval(1e-4,1e-2)", "hydra.sweep.dir=search"]) == 0
    finally:
        library.removeHandler(handler)
    optuna_lines = [line for line in console.getvalue().splitlines() if "A new study created" in line]
    assert optuna_lines, console.getvalue()  # Optuna spoke
    assert any("\x1b[" in line for line in optuna_lines) == terminal, optuna_lines
    assert ("NO_COLOR" in os.environ) != terminal
    capfd.readouterr()


def test_sweep_errors_are_one_line_before_any_job(stub_jobs: list[list[str]],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        ("hydra/sweeper=nevergrad", "a=1,2"): "hydra/sweeper=nevergrad is not installed: pip install "
                                              "hydra-nevergrad-sweeper",
        ("hydra/launcher=nope", "a=1,2"): "hydra/launcher=nope is not installed: installed: basic, ddptrain",
        ("sweep.partition=gpu", "a=1,2"): "sweep.partition was replaced by Hydra's launcher plugins: use "
                                          "hydra.launcher.partition",
        ("sweep.objective=loss", "train.steps=1,2"): "sweep.objective='loss': expected one of final_val_loss",
        ("train.stepz=1,2",): "train.stepz: Key 'stepz' not in 'TrainConfig'",
        ("--fail-fast", "hydra/launcher=submitit_local", "a=1,2"): "--fail-fast stops a sweep whose jobs run one "
        "after another (hydra/launcher=ddptrain); hydra/launcher=submitit_local runs them as it sees fit",
    }
    for args, message in cases.items():
        if "submitit_local" in args and "submitit_local" not in installed("hydra/launcher"):
            continue
        assert run_cli(["-m", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"ddptrain: error: {message}"), (args, err)
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    assert run_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize", "train.steps=1,2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ddptrain: error: hydra.sweeper.direction=maximize but sweep.direction=minimize (for "
        "sweep.objective=final_val_loss): make them agree")
    assert stub_jobs == []


def test_help_lists_the_installed_sweepers_and_launchers(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sweepers = next(line for line in lines if line.strip().startswith("hydra/sweeper:")).split(":", 1)[1]
    launchers = next(line for line in lines if line.strip().startswith("hydra/launcher:")).split(":", 1)[1]
    assert {"basic", "optuna"} <= {s.strip() for s in sweepers.split(",")}
    assert {"basic", "ddptrain", "submitit_local", "submitit_slurm"} <= {s.strip() for s in launchers.split(",")}


@pytest.fixture
def cache(cli_runs: RunCache) -> Path:
    """The session's data cache (``tests/helpers/run_cache.py``) for the module's sweeps: TINY's tokenizer and
    tokens are prepared once for these sweeps and every other CLI test training on TINY's data."""
    return cli_runs.data_cache


@pytest.mark.slow
def test_multirun_runs_each_job_with_its_own_workers_and_writes_the_comparison(tmp_path: Path, cache: Path) -> None:
    # TINY's two steps (the second is the steady window the summary's figures come from); a global batch of 4: one
    # micro batch of 2 on each of the 2 ranks
    fixed = without(TINY, "data.global_batch_size")
    sweep = ["-m", "parallel.bucket_cap_mb=1,25", "launch.nproc_per_node=2", *fixed,
             "data.global_batch_size=4", "hydra.sweep.dir=sweep"]
    result = run_command(sweep, cwd=tmp_path, cache=cache, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "sweep")
    assert [r["parallel.bucket_cap_mb"] for r in rows] == ["1", "25"]
    for num, row in enumerate(rows):
        summary = json.loads((tmp_path / "sweep" / str(num) / "summary.json").read_text())
        assert summary["world_size"] == 2 and float(row["tokens_per_s"]) == pytest.approx(summary["tokens_per_s"])
        assert row["status"] == "ok" and float(row["comm_bytes"]) > 0
    md = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "| job | parallel.bucket_cap_mb | tokens/s |" in md and "ddptrain --multirun" in md
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 5_000


@pytest.mark.slow
def test_a_failing_job_is_reported_and_the_sweep_goes_on(tmp_path: Path, cache: Path) -> None:
    # a micro batch of 3 does not divide the global batch of 2: job 0 fails at start-up, job 1 trains
    sweep = ["-m", "data.micro_batch_size=3,2", *without(TINY, "data.micro_batch_size"), "hydra.sweep.dir=sweep"]
    result = run_command(sweep, cwd=tmp_path, cache=cache, timeout=600)
    assert result.returncode == 1
    assert ("sweep job 0 failed: ddptrain: error: data.global_batch_size=2 is not divisible by "
            "data.micro_batch_size=3") in result.stderr
    rows = _rows(tmp_path / "sweep")
    assert [r["status"][:6] for r in rows] == ["failed", "ok"] and float(rows[1]["tokens_per_s"]) > 0


@pytest.mark.slow
def test_a_real_optuna_search_over_an_interval_trains_a_batch_of_two_trials(tmp_path: Path, cache: Path) -> None:
    """Two trials, asked for as one batch (n_jobs): each trains its own lr and hands its job's final_val_loss to the
    sweeper, whose best is the smaller (a third trial was one more job process, 8 CPU s, and checked nothing more;
    the stand-in search above samples four)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
            "optim.lr=interval(1e-4,3e-3)", *without(TINY, "train.eval_every"), "train.eval_every=2",
            "hydra.sweep.dir=search"]
    result = run_command(args, cwd=tmp_path, cache=cache, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "search")
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    assert len({r["optim.lr"] for r in rows}) == 2  # two points of the interval: the best is a choice
    for row in rows:
        summary = json.loads((tmp_path / "search" / row["job"] / "summary.json").read_text())
        assert float(row["objective: final_val_loss"]) == pytest.approx(summary["final_val_loss"])
        config = yaml.safe_load((tmp_path / "search" / row["job"] / "config.yaml").read_text())
        assert config["optim"]["lr"] == pytest.approx(float(row["optim.lr"]))  # the trial's lr trained
    best = yaml.safe_load((tmp_path / "search" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(float(r["objective: final_val_loss"]) for r in rows))
    assert "Best of the optuna search" in (tmp_path / "search" / "sweep.md").read_text()


@pytest.mark.slow
def test_a_sweep_through_hydras_submitit_local_launcher_trains_and_reports(tmp_path: Path, cache: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    # job 0 cannot start (a micro batch of 3 does not divide the global batch of 2), job 1 trains
    args = ["-m", "hydra/launcher=submitit_local", "data.micro_batch_size=3,2",
            *without(TINY, "data.micro_batch_size"), "hydra.sweep.dir=sweep"]
    result = run_command(args, cwd=tmp_path, cache=cache, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "sweep of 2 jobs in sweep: 1 succeeded, failed: 0" in result.stderr
    rows = _rows(tmp_path / "sweep")
    assert [r["status"][:6] for r in rows] == ["failed", "ok"] and float(rows[1]["tokens_per_s"]) > 0
    assert "data.global_batch_size=2 is not divisible" in rows[0]["status"]
    assert list((tmp_path / "sweep" / ".submitit").rglob("*_log.err"))  # submitit ran them


def test_each_readme_command_with_a_plugin_from_an_extra_names_the_extra() -> None:
    """A new user copies the README's Optuna line and meets "hydra/sweeper=optuna is not installed": the line
    itself says which extra brings the plugin, as the Ray line does."""
    from ddptrain.app.sweep import PLUGINS

    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    checked = 0
    for (group, choice), install in PLUGINS.items():
        if "ddptrain[" not in install:
            continue
        extra = install.split(" (")[0]  # pip install 'ddptrain[optuna]'
        for line in readme:
            if f"{group}={choice}" in line and line.startswith("ddptrain "):
                checked += 1
                assert extra in line, line
    assert checked >= 1  # the Optuna line


def test_sweep_png_labels_do_not_collide_and_the_legend_covers_no_bar(tmp_path: Path) -> None:
    """Eight jobs over two keys: the x labels of each panel may not overlap one another, nor leave the figure,
    and the breakdown's legend may not cover its bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    from ddptrain.app.sweep_job import JobResult
    from ddptrain.app.sweep_report import BREAKDOWN, figure

    results = [JobResult(i, [f"parallel.bucket_cap_mb={cap}", f"optim.lr={lr}"], tmp_path, 0,
                         {"tokens_per_s": 1000.0 + 100 * i, **{key: 0.01 * (1 + i) for key in BREAKDOWN}})
               for i, (cap, lr) in enumerate((c, lr) for c in (1, 5, 25, 100) for lr in (1e-4, 3e-3))]
    fig = figure(results, ["parallel.bucket_cap_mb", "optim.lr"])
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    whole = fig.bbox
    tput, parts = fig.axes[:2]
    for axes in (tput, parts):
        boxes = [label.get_window_extent(renderer) for label in axes.get_xticklabels() if label.get_text()]
        assert len(boxes) == 8
        for i, a in enumerate(boxes):
            assert whole.x0 <= a.x0 and a.x1 <= whole.x1 and whole.y0 <= a.y0, (axes.get_title(), i)
            for j, b in enumerate(boxes[i + 1:], i + 1):
                assert not a.overlaps(b), (axes.get_title(), i, j)
    legend = parts.get_legend().get_window_extent(renderer)
    bars = Bbox.union([patch.get_window_extent(renderer) for patch in parts.patches])
    assert not legend.overlaps(bars) and not legend.overlaps(parts.bbox)
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1
