"""From Hydra's composed config to the typed schema: register the schema, strip Hydra's node, build a Config.

Hydra composes the YAML groups; these helpers hand the result to the dataclasses of ``ddptrain/config.py``,
which check it (unknown key, wrong type, unknown choice, ``__post_init__`` rules) with one-line errors.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddptrain.config import Config
from ddptrain.errors import ConfigError, one_line


def job_config(cfg: DictConfig) -> DictConfig:
    """A composed config without Hydra's own ``hydra`` node: what the run itself is configured with."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    assert isinstance(job, DictConfig)
    return job


def build_config(*layers: DictConfig | dict[str, Any]) -> Config:
    """The schema's defaults with each layer merged on top, checked against the schema and typed (one-line
    ConfigError otherwise)."""
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), *layers))
    except OmegaConfBaseException as exc:  # unknown key, wrong type, unknown choice
        raise ConfigError(one_line(exc)) from exc
    assert isinstance(typed, Config)
    return typed


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore; group files merge into its typed nodes and are checked there."""
    ConfigStore.instance().store(name="ddptrain_schema", node=Config)
