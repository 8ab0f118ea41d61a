"""ddptrain as a Hydra app: configs found after a plain install, the user's config dir, --help, choices (multirun:
tests/test_sweep.py)."""

from __future__ import annotations

import dataclasses
import enum
import json
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from ddptrain.app.cli import run_cli
from ddptrain.app.help import config_groups, schema_keys
from ddptrain.config.compose import config_dir
from ddptrain.config.schema import Config
from tests.helpers import procs
from tests.helpers.cli import test_env
from tests.helpers.install import throwaway_install
from tests.helpers.run_cache import RunCache
from tests.helpers.tiny import TINY_RUN_ARGS as TINY
from tests.helpers.tiny import without

REPO = Path(__file__).parents[1]
def test_every_package_ships_in_the_wheel() -> None:
    """pyproject lists packages by hand (find cannot map configs/ in): a new subpackage must not be forgotten.
    ``hydra_plugins``, Hydra's namespace package, is listed too (see the plugin scan test below)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(REPO).parts)
               for root in ("ddptrain", "hydra_plugins") for p in (REPO / root).rglob("__init__.py")}
    assert not (REPO / "hydra_plugins" / "__init__.py").exists()  # a namespace: other plugins share it
    assert present | {"ddptrain.configs", "hydra_plugins"} == listed


# Hydra's plugin scan alone, as ``ddptrain -m`` meets it (no ddptrain module imported first)
PLUGIN_SCAN = ("from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
               "print(sorted(c.__name__ for c in Plugins.instance().discover(Launcher)))")


def test_hydras_plugin_scan_finds_our_launcher_in_this_environments_install(tmp_path: Path) -> None:
    """The launcher is found by Hydra's scan of the ``hydra_plugins`` namespace as the install laid it out (here
    the README's ``pip install -e``), from outside the checkout; with setuptools' editable finder that needs
    ``hydra_plugins`` listed as a package in pyproject (otherwise its path holds no directory of ours)."""
    found = subprocess.run([sys.executable, "-c", PLUGIN_SCAN], capture_output=True, text=True, cwd=tmp_path,
                           env=test_env(tmp_path / "cache"), timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "DdptrainLauncher" in found.stdout, (
        f"Hydra's scan lists {found.stdout.strip()}: an install made before hydra_plugins was listed as a "
        f"package in pyproject.toml needs re-installing (pip install -e .)")


@pytest.mark.slow
def test_a_fresh_editable_install_exposes_the_launcher_to_hydras_plugin_scan(tmp_path: Path) -> None:
    """The same scan after ``pip install -e .`` into a new environment (not this one, which may predate a change
    of pyproject): no ddptrain module imported first, from outside the checkout."""
    bin_dir = throwaway_install(tmp_path, editable=True)
    found = subprocess.run([bin_dir / "python", "-c", PLUGIN_SCAN], capture_output=True, text=True, cwd=tmp_path,
                           env=test_env(tmp_path / "cache"), timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "DdptrainLauncher" in found.stdout, found.stdout


@pytest.mark.slow
def test_a_plain_install_trains_and_sweeps_on_a_grid_and_with_optuna(tmp_path: Path, cli_runs: RunCache) -> None:
    """``pip install .`` (not editable) into a new environment: the configs travel inside the package, the
    launcher plugin in ``hydra_plugins``; its ``ddptrain`` composes, trains, and runs both kinds of sweep from a
    directory of the user's own. TINY's data comes from the session's data cache, prepared once for every CLI test
    that trains on it (``tests/helpers/run_cache.py``)."""
    bin_dir = throwaway_install(tmp_path)
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    assert (site / "ddptrain" / "configs" / "experiment" / "quickstart.yaml").is_file()
    assert (site / "hydra_plugins" / "ddptrain_launcher" / "ddptrain_launcher.py").is_file()  # ddptrain -m's
    assert not (site / "hydra_plugins" / "__init__.py").exists()  # the namespace other plugins share
    cwd, env = tmp_path / "project", test_env(cli_runs.data_cache)
    cwd.mkdir()

    def ddptrain(*args: str) -> subprocess.CompletedProcess[str]:
        return procs.run([bin_dir / "ddptrain", *args], env=env, capture_output=True, text=True, cwd=cwd,
                         timeout=300, stdin=subprocess.DEVNULL)

    where = subprocess.run([bin_dir / "python", "-c", "import ddptrain.config.compose as c; print(c.config_dir())"],
                           env=env, capture_output=True, text=True, cwd=cwd, check=True)
    assert where.stdout.strip() == str(site / "ddptrain" / "configs")
    shown = ddptrain("--cfg", "job", "+experiment=quickstart")
    assert shown.returncode == 0 and "nproc_per_node: 2" in shown.stdout, shown.stderr[-2000:]
    trained = ddptrain(*TINY, "hydra.run.dir=run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((cwd / "run" / "summary.json").read_text())["steps"] == 2
    grid = ddptrain("-m", "train.steps=1,2", *without(TINY, "train.steps"), "hydra.sweep.dir=grid")
    assert grid.returncode == 0, grid.stderr[-3000:]
    assert [json.loads((cwd / "grid" / str(n) / "summary.json").read_text())["steps"] for n in (0, 1)] == [1, 2]
    # one trial: what is tested here is that the plugins load from this install (test_sweep.py searches)
    search = ddptrain("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "optim.lr=interval(1e-4,3e-3)",
                      *without(TINY, "train.eval_every"), "train.eval_every=2", "hydra.sweep.dir=search")
    assert search.returncode == 0, search.stderr[-3000:]
    assert "Best of the optuna search" in (cwd / "search" / "sweep.md").read_text()
    assert "final_val_loss" in json.loads((cwd / "search" / "0" / "summary.json").read_text())


@pytest.fixture
def user_configs(tmp_path: Path) -> Path:
    root = tmp_path / "my_configs"
    (root / "experiment").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "model" / "my_tiny.yaml").write_text("name: my_tiny\narch: gpt2\nhidden_size: 32\nnum_layers: 1\n"
                                                 "num_heads: 2\nmax_position_embeddings: 64\n")
    (root / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: my_tiny\ndata:\n  seq_len: 32\ntrain:\n  steps: 2\n")
    return root


def test_a_user_config_dir_adds_an_experiment_and_a_model_that_train(
    user_configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    cli_runs: RunCache,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(cli_runs.data_cache))  # TINY's data, prepared once per session
    assert run_cli(["-cd", str(user_configs), "--cfg", "job", "+experiment=mine"]) == 0
    shown = capsys.readouterr().out
    assert "name: my_tiny" in shown and "arch: gpt2" in shown and "seq_len: 32" in shown
    assert run_cli(["--config-dir", str(user_configs), "+experiment=mine", *TINY, "hydra.run.dir=run"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "my_tiny" and summary["steps"] == 2
    # the same names without the directory: the one-line "available" message, which lists ours only
    assert run_cli(["+experiment=mine"]) == 2
    assert "ddptrain: error: Could not find 'experiment/mine'; available: bucket_sweep" in capsys.readouterr().err
    assert run_cli(["model=my_tiny"]) == 2
    assert "Could not find 'model/my_tiny'" in capsys.readouterr().err


def test_config_name_picks_another_primary_config(user_configs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (user_configs / "small.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 7\n")
    assert run_cli(["-cd", str(user_configs), "-cn", "small", "--cfg", "job"]) == 0
    shown = capsys.readouterr().out
    # the YAML alone, ending in its last line's newline (what `> config.yaml` or a YAML reader takes)
    assert yaml.safe_load(shown)["train"]["steps"] == 7
    assert shown.endswith("\n") and not shown.endswith("\n\n")


def test_a_config_dir_that_does_not_exist_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["-cd", "/no/such/dir", "--cfg", "job"]) == 2
    assert capsys.readouterr().err.strip() == "ddptrain: error: --config-dir /no/such/dir: no such directory"


def test_help_lists_every_group_choice_and_schema_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    text = capsys.readouterr().out
    groups = {p.parent.relative_to(config_dir()).as_posix() for p in config_dir().rglob("*.yaml")} - {"."}
    assert {"model", "data", "parallel", "optim", "logger", "experiment", "parallel/compression"} <= groups
    for path in config_dir().rglob("*/*.yaml"):  # every choice file of every group, so none can be forgotten
        group = path.parent.relative_to(config_dir()).as_posix()
        line = next(line for line in text.splitlines() if line.strip().startswith(f"{group}:"))
        assert path.stem in line.split(":", 1)[1].split(", ") or f" {path.stem}" in line, (group, path.stem)
    for option in ("--cfg", "--resolve", "-m, --multirun", "-cd, --config-dir", "-cn, --config-name",
                   "hydra.searchpath"):
        assert option in text
    assert "train.precision: auto|fp32|bf16|fp16 = auto" in text and "parallel.bucket_cap_mb: float = 25.0" in text
    assert "model.num_kv_heads: int | null = null" in text  # a default of None as YAML writes it
    listed = [line.split(":", 1)[0].strip() for line in text.splitlines()
              if line.startswith("  ") and ": " in line and " = " in line]
    assert sorted(listed) == sorted(_schema_leaves(OmegaConf.structured(Config)))  # every key once, none extra
    assert len({k for k, _, _ in schema_keys()}) == len(listed)
    assert config_groups([config_dir()])["parallel"] == ["ddp", "fsdp_offload", "zero1", "zero2", "zero3"]


def _schema_leaves(node: DictConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema as OmegaConf holds it (what Hydra accepts), walked without ddptrain.app.help."""
    keys = []
    for key in node:
        if dataclasses.is_dataclass(OmegaConf.get_type(node, str(key))):  # a section: its leaves
            keys += _schema_leaves(node[key], f"{prefix}{key}.")
        else:  # a value, or a free-form dict of the user's (sweep.slurm_additional)
            keys.append(f"{prefix}{key}")
    return keys


def _choice_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, type[enum.Enum]]]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            found += _choice_fields(tp, f"{prefix}{f.name}.")
        else:
            enums = [a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, enum.Enum)]
            found += [(f"{prefix}{f.name}", enums[0])] if enums else []
    return found


def test_every_choice_field_rejects_a_bad_value_at_composition(capsys: pytest.CaptureFixture[str]) -> None:
    fields = _choice_fields()
    assert {"data.source", "parallel.engine", "parallel.compression", "train.precision", "train.nan_policy",
            "optim.schedule", "dist.backend", "model.arch"} <= {k for k, _ in fields}
    for key, choices in fields:
        assert run_cli(["--cfg", "job", f"{key}=bogus"]) == 2, key  # --cfg: composition alone, no training
        allowed = ", ".join(c.value for c in choices)
        assert capsys.readouterr().err.strip() == f"ddptrain: error: {key}='bogus': expected one of {allowed}"
