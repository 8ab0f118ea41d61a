"""``ddptrain -m``: a multirun through Hydra's own sweeper and launcher plugins.

The command line goes to ``hydra.main`` as a Hydra app's would: the sweeper (``hydra/sweeper=basic`` by default:
grids, ``range()``, ``choice()``, ``hydra.sweeper.params``; or any installed one, such as ``optuna`` with
``interval()``) turns it into jobs, the launcher (``hydra/launcher=ddptrain`` by default: one after another on
this machine; or ``submitit_slurm``, ``submitit_local``, ``joblib``...) runs them, and each job is the task
function of ``ddptrain.app.sweep_job``: a full ``python -m ddptrain`` in its own process that returns
``sweep.objective`` to the sweeper. The ``sweep_report`` callback writes ``sweep.md``/``.csv``/``.png`` at the
end. Composition uses the same directories as a single run (a user's ``--config-dir`` first, ours after it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from omegaconf import DictConfig, OmegaConf

from ddptrain.app import sweep_report
from ddptrain.app.sweep_job import SweepJobFailed, results_in, sweep_job
from ddptrain.config.compose import Source, build_config, compose_config, primary_of, register_schema
from ddptrain.errors import ConfigError, one_line, say

# where the plugins of the Hydra ecosystem come from, for the one-line error when one is not installed
PLUGINS = {
    ("hydra/sweeper", "optuna"): "pip install 'ddptrain[optuna]' (hydra-optuna-sweeper)",
    ("hydra/sweeper", "nevergrad"): "pip install hydra-nevergrad-sweeper",
    ("hydra/sweeper", "ax"): "pip install hydra-ax-sweeper",
    ("hydra/launcher", "submitit_slurm"): "pip install 'ddptrain[submitit]' (hydra-submitit-launcher)",
    ("hydra/launcher", "submitit_local"): "pip install 'ddptrain[submitit]' (hydra-submitit-launcher)",
    ("hydra/launcher", "joblib"): "pip install hydra-joblib-launcher",
    ("hydra/launcher", "ray"): "pip install hydra-ray-launcher",
}
REMOVED = {  # the keys of the hand-written submission that Hydra's submitit launcher replaced
    "sweep.launcher": "hydra/launcher=submitit_slurm (or submitit_local)",
    "sweep.cluster": "hydra/launcher=submitit_slurm or hydra/launcher=submitit_local",
    "sweep.partition": "hydra.launcher.partition", "sweep.gpus_per_node": "hydra.launcher.gpus_per_node",
    "sweep.cpus_per_task": "hydra.launcher.cpus_per_task", "sweep.mem_gb": "hydra.launcher.mem_gb",
    "sweep.timeout_min": "hydra.launcher.timeout_min",
    "sweep.slurm_additional": "hydra.launcher.additional_parameters",
}


def installed(group: str) -> list[str]:
    """The choices of ``hydra/sweeper`` or ``hydra/launcher`` that are installed here (each plugin registers its
    configs when Hydra imports it)."""
    Plugins.instance()
    register_schema()  # ours too
    return sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group) if name.endswith(".yaml"))


def check_overrides(overrides: list[str], fail_fast: bool) -> None:
    """One-line errors for what Hydra would answer with a long one: a plugin that is not installed, a key of
    the old submission, ``--fail-fast`` with a launcher that runs the jobs at once."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    chosen = {o.get_key_element().lstrip("+~"): "" if o.is_sweep_override() else o.get_value_element_as_str()
              for o in parsed}
    for group in ("hydra/sweeper", "hydra/launcher"):
        name = chosen.get(group)
        if name is None:
            continue
        available = installed(group)
        if name not in available:
            hint = PLUGINS.get((group, name), f"installed: {', '.join(available)}")
            raise ConfigError(f"{group}={name} is not installed: {hint}")
    for key in chosen:
        replaced = next((new for old, new in REMOVED.items() if key == old or key.startswith(f"{old}.")), None)
        if replaced is not None:
            raise ConfigError(f"{key} was replaced by Hydra's launcher plugins: use {replaced}")
    if fail_fast and chosen.get("hydra/launcher", "ddptrain") != "ddptrain":
        raise ConfigError(f"--fail-fast stops a sweep whose jobs run one after another (hydra/launcher=ddptrain); "
                          f"hydra/launcher={chosen['hydra/launcher']} runs them as it sees fit")


def check_objective(config: DictConfig) -> None:
    """``sweep.*`` checked before any job runs (every job shares it). A searching sweeper optimizes in its own
    direction (``hydra.sweeper.direction``): it must be the one of the objective each job returns
    (``sweep.direction``), or the search would run away from the goal."""
    build_config({"sweep": config.sweep})
    theirs = config.hydra.sweeper.get("direction")
    if theirs is None:
        return
    if OmegaConf.is_list(theirs):
        raise ConfigError(f"hydra.sweeper.direction={list(theirs)}: each ddptrain job returns one objective "
                          f"(sweep.objective={config.sweep.objective}); give one direction")
    theirs = theirs.name if isinstance(theirs, Enum) else str(theirs)  # Optuna's config holds an Enum
    if theirs != str(config.sweep.direction):
        raise ConfigError(f"hydra.sweeper.direction={theirs} but sweep.direction={config.sweep.direction} "
                          f"(for sweep.objective={config.sweep.objective}): make them agree")


def run_sweep(source: Source, fail_fast: bool = False) -> int:
    """Run the multirun through Hydra; non-zero when some job failed."""
    if "LOCAL_RANK" in os.environ:
        raise ConfigError("--multirun launches the workers of each job itself: run it without torchrun")
    check_overrides(source.overrides, fail_fast)
    check_objective(compose_config(source, multirun=True))
    no_colour_off_a_terminal()
    primary, name, overrides = primary_of(source)
    overrides = [*overrides, "hydra.job.name=ddptrain", *(["hydra.launcher.fail_fast=true"] if fail_fast else [])]
    app = hydra.main(config_path=str(primary), config_name=name, version_base="1.3")(sweep_job)
    stopped = False
    sweep_report.started.clear()
    with _hydra_command_line(overrides):
        try:
            app()
        except SweepJobFailed:
            stopped = True  # the sweeper stops at a failed job (the basic one does, after its batch)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(one_line(exc)) from exc
    if not sweep_report.started:
        raise ConfigError("the sweep did not start")
    config, since = sweep_report.started[-1]
    sweep_dir = Path(str(config.hydra.sweep.dir))
    # the callback writes the report when the sweeper finishes; when it stopped on a failure, it is written here
    results = sweep_report.write_report(sweep_dir, sweep_report.command_of(config), since) if stopped \
        else results_in(sweep_dir, since)
    failed = [r.num for r in results if not r.ok]
    say(f"ddptrain: sweep of {len(results)} jobs in {sweep_dir}: {len(results) - len(failed)} succeeded"
        + (f", failed: {', '.join(map(str, failed))}" if failed else "") + "; see sweep.md, sweep.csv, sweep.png")
    return 1 if failed or stopped else 0


def no_colour_off_a_terminal() -> None:
    """Optuna logs through colorlog, whose formatter writes colour escapes unless told not to (Optuna gives it no
    stream to check for a terminal): in a CI log, a file or a pipe they are noise. Off a terminal, ``NO_COLOR``
    (no-color.org, which colorlog honours at each line) is set for this process and its jobs; a user's
    ``FORCE_COLOR`` still wins."""
    if not sys.stderr.isatty():
        os.environ.setdefault("NO_COLOR", "1")


@contextlib.contextmanager
def _hydra_command_line(overrides: list[str]) -> Iterator[None]:
    """``hydra.main`` reads its command line from ``sys.argv``; its errors are raised, not printed, so they
    reach the user as one line (``HYDRA_FULL_ERROR``)."""
    saved_argv, saved_full = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = ["ddptrain", "--multirun", *overrides]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_full is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full

