"""Hydra composition onto the typed schema: where the config groups live, what the command line asks for, and the
composed config checked against the dataclasses of ``ddptrain/config/schema.py`` (one-line errors).

Composition uses Hydra's public API only (``initialize_config_dir``/``compose``, the ConfigStore and the override
parser). A user's ``--config-dir`` is the primary directory, so its files win over ours of the same name; ours
follow it on the search path (``hydra.searchpath``), then any ``hydra.searchpath`` entries the user gives. Hydra
looks the primary config up before it reads ``hydra.searchpath``, so with a user's directory that lacks it, our
primary config is composed from a copy in the ConfigStore under its own name (``ddptrain_primary_<name>``; a copy
under the file's name would be taken for a schema of that file).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError, one_line

PRIMARY = "config"
SEARCHPATH = "hydra.searchpath"


def config_dir() -> Path:
    """The config groups: shipped inside the package (``pip install .``, Docker), else the checkout's ``configs/``."""
    installed = Path(__file__).parents[1] / "configs"
    return installed if installed.is_dir() else Path(__file__).parents[2] / "configs"


@dataclass
class Source:
    """Where the config comes from: our groups, a user's directory overlaid on them, the primary config's name."""

    user_dir: Path | None = None  # --config-dir: its groups overlay ours (same name: the user's file wins)
    name: str = PRIMARY  # --config-name
    overrides: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """The command-line arguments that recreate this source in a worker or a sweep's job."""
        head = ["--config-dir", str(self.user_dir)] if self.user_dir else []
        return [*head, *(["--config-name", self.name] if self.name != PRIMARY else []), *self.overrides]


def _with_our_groups_searched(overrides: list[str]) -> list[str]:
    """``overrides`` with our config directory first on ``hydra.searchpath`` (the user's entries after it)."""
    ours = f"file://{config_dir()}"
    parser = OverridesParser.create()
    rest, theirs = [], []
    for text, parsed in zip(overrides, parser.parse_overrides(overrides), strict=True):
        if parsed.get_key_element().lstrip("+~") == SEARCHPATH:
            value = parsed.value()
            theirs = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        else:
            rest.append(text)
    entries = ",".join(f"'{p}'" for p in [ours, *theirs])
    return [*rest, f"{SEARCHPATH}=[{entries}]"]


def _without_sweeps(overrides: list[str]) -> list[str]:
    """The overrides a sweep's jobs share: sweeps (``a=1,2``, ``range()``, ``choice()``) are left for the sweep."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [text for text, o in zip(overrides, parsed, strict=True) if not o.is_sweep_override()]


def compose_config(source: Source | list[str], multirun: bool = False) -> DictConfig:
    """The composed config with its ``hydra`` node, checked against the schema (one-line errors).

    ``multirun``: sweep overrides (``a=1,2``) are left for the sweep; the rest composes as usual.
    """
    if isinstance(source, list):
        source = Source(overrides=source)
    register_schema()
    try:
        swept = Source(source.user_dir, source.name, _without_sweeps(source.overrides)) if multirun else source
        primary, name, overrides = primary_of(swept)
        with initialize_config_dir(config_dir=str(primary), job_name="ddptrain", version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    return cfg


def primary_of(source: Source) -> tuple[Path, str, list[str]]:
    """Where Hydra starts composing ``source``: the primary directory (the user's, else ours), the primary
    config's name there, and the overrides with our directory searched after the user's."""
    overrides = list(source.overrides)
    if source.user_dir is None:
        return config_dir(), source.name, overrides
    name = source.name
    if not (source.user_dir / f"{name}.yaml").is_file():
        name = _stored_primary(name)
    return source.user_dir, name, _with_our_groups_searched(overrides)


def job_config(cfg: DictConfig) -> DictConfig:
    """A composed config without Hydra's own ``hydra`` node: what the run itself is configured with."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    assert isinstance(job, DictConfig)
    return job


@functools.cache
def _schema_defaults() -> DictConfig:
    """The schema's defaults as a config, built once per process: 30 ms of the 50 a ``build_config`` took, paid by
    every process that composes a run and every in-process test run. ``OmegaConf.merge`` merges into a deep copy
    of its first argument, so the one built here is never changed."""
    return OmegaConf.structured(Config)


def build_config(*layers: DictConfig | dict[str, Any]) -> Config:
    """The schema's defaults with each layer merged on top, checked against the schema and typed (one-line
    ConfigError otherwise)."""
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(_schema_defaults(), *layers))
    except OmegaConfBaseException as exc:  # unknown key, wrong type, unknown choice
        raise ConfigError(one_line(exc)) from exc
    assert isinstance(typed, Config)
    return typed


@dataclass(frozen=True)
class Run:
    """One composed run: the config with Hydra's node, the same as the schema's dataclasses, and as a plain
    resolved dict (for W&B and the run dir). Resolved once, here."""

    cfg: DictConfig
    typed: Config
    resolved: dict[str, Any]


def typed_config(cfg: DictConfig) -> Run:
    """Resolve and type the job config once; a bad interpolation or a failed schema check is bad input."""
    job = job_config(cfg)
    try:
        resolved = OmegaConf.to_container(job, resolve=True, throw_on_missing=True, enum_to_str=True)
        typed = build_config(resolved)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    assert isinstance(resolved, dict)
    # the checkpointing mode in effect, also when the deprecated model.gradient_checkpointing chose it
    resolved["model"]["activation_checkpointing"] = str(typed.model.activation_checkpointing)
    return Run(cfg, typed, resolved)


SCHEMA_NAME = "ddptrain_schema"  # configs/config.yaml's first default


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore; group files merge into its typed nodes and are checked there. Our
    launcher plugin registers ``hydra/launcher=ddptrain``, the primary config's choice, on import: imported here,
    composing never depends on Hydra's plugin scan. Running it as a launcher does: the scan must find it in the
    ``hydra_plugins`` namespace, which pyproject's package list makes every install (editable too) lay out."""
    import hydra_plugins.ddptrain_launcher.ddptrain_launcher  # noqa: F401  # registers on import

    store = ConfigStore.instance()
    # Once per process: building the node from the dataclasses was a fifth of each compose (a process composing many
    # configs, a sweep's or the tests', paid it every time); Hydra deep-copies what it loads, so the stored node is
    # never changed by a composition.
    if f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=Config)


def _stored_primary(name: str) -> str:
    """The ConfigStore name of a copy of our primary config ``name`` (``name`` itself when we have none)."""
    path = config_dir() / f"{name}.yaml"
    if not path.is_file():
        return name
    stored = f"ddptrain_primary_{name}"
    ConfigStore.instance().store(name=stored, node=OmegaConf.load(path))
    return stored
