"""The config groups state only what differs from the schema: the dataclasses are the one source of defaults."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ddptrain.config.compose import config_dir
from ddptrain.config.schema import Config

# (group file, key) pairs that must repeat the schema's default because Hydra's composition would otherwise leave
# an earlier file's value in place (a file that includes another in its defaults list and sets a key back, say).
# Each entry needs its reason beside it; none does today.
NEEDED_BY_COMPOSITION: dict[tuple[str, str], str] = {}


def _leaves(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _package(path: Path, root: Path) -> str:
    """Where a group file's keys land: its ``# @package`` line, else its top-level group (``parallel/engine`` ->
    ``parallel``)."""
    for line in path.read_text().splitlines():
        if line.startswith("# @package "):
            return line.removeprefix("# @package ").strip()
    return path.relative_to(root).parts[0]


def repeated_defaults(root: Path) -> list[str]:
    """Every ``file: key = value`` in the group files under ``root`` (experiments aside: they overlay the composed
    config, not the schema) whose value is the schema's default for that key."""
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    assert isinstance(defaults, dict)
    found = []
    for path in sorted(root.rglob("*/*.yaml")):
        name = path.relative_to(root).as_posix()
        if name.startswith("experiment/"):
            continue
        body = OmegaConf.to_container(OmegaConf.load(path)) or {}
        assert isinstance(body, dict)
        body.pop("defaults", None)
        schema: Any = defaults
        for part in _package(path, root).split("."):
            schema = schema[part]
        for key, value in _leaves(body):
            default = schema
            for part in key.split("."):
                default = default[part]
            if value == default and (name, key) not in NEEDED_BY_COMPOSITION:
                found.append(f"{name}: {key} = {value!r}")
    return found


def test_no_group_file_repeats_a_schema_default() -> None:
    assert repeated_defaults(config_dir()) == []


def test_a_group_file_repeating_a_default_is_found(tmp_path: Path) -> None:
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "adamw.yaml").write_text("lr: 1.0e-3\nwarmup_steps: 20\n")
    (tmp_path / "parallel" / "engine").mkdir(parents=True)
    (tmp_path / "parallel" / "engine" / "torchy.yaml").write_text("# @package parallel\nengine: torch\n")
    assert repeated_defaults(tmp_path) == ["optim/adamw.yaml: lr = 0.001",
                                           "parallel/engine/torchy.yaml: engine = 'torch'"]


def test_the_schema_is_stored_once_per_process_and_no_composition_changes_it() -> None:
    """``register_schema`` builds the schema's node once (a sweep composes many configs, the tests hundreds): a
    second call keeps the stored node, which is sound because Hydra composes from a copy of it (a composition's
    overrides leave the stored schema's defaults as the dataclasses state them)."""
    from hydra.core.config_store import ConfigStore

    from ddptrain.config.compose import SCHEMA_NAME, compose_config, register_schema

    register_schema()
    repo = ConfigStore.instance().repo
    stored = repo[f"{SCHEMA_NAME}.yaml"]
    register_schema()
    assert repo[f"{SCHEMA_NAME}.yaml"] is stored
    composed = compose_config(["train.steps=7", "optim.lr=0.5"])
    assert (composed.train.steps, composed.optim.lr) == (7, 0.5)
    assert OmegaConf.to_container(stored.node) == OmegaConf.to_container(OmegaConf.structured(Config))


def test_build_config_composes_from_the_schemas_defaults_and_no_build_changes_them() -> None:
    """``build_config`` merges onto the schema's defaults built once per process (every in-process run and every
    forked rank composes its config with it); the merge works on a copy, so one build's layers never reach the next
    build."""
    from ddptrain.config.compose import build_config

    built = build_config({"train": {"steps": 7}, "optim": {"lr": 0.5}})
    assert (built.train.steps, built.optim.lr) == (7, 0.5)
    fresh = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config)))  # the defaults, built anew here
    assert OmegaConf.to_container(OmegaConf.structured(build_config())) == \
        OmegaConf.to_container(OmegaConf.structured(fresh))


def test_build_config_builds_the_schemas_defaults_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema's defaults (30 ms of a build's 50) are built by the process's first ``build_config``, not again
    by every later one (each in-process test run and forked rank composes its config)."""
    from ddptrain.config.compose import build_config

    build_config()
    built: list[object] = []
    structured = OmegaConf.structured
    monkeypatch.setattr(OmegaConf, "structured", lambda *a, **k: built.append(a[0]) or structured(*a, **k))
    assert build_config({"train": {"steps": 7}}).train.steps == 7 and build_config().train.steps == 100
    assert built == [], f"build_config built the schema's defaults again: {len(built)} times in 2 builds"
