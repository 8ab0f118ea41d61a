"""``ddptrain --help``: the options, every config group with its choices, and every key of the schema.

Groups and choices are read from the config directories themselves (ours, and the user's ``--config-dir``),
keys, types and defaults from the dataclass schema: nothing here is a second list that could fall behind.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path

from ddptrain.app.sweep import installed
from ddptrain.config.compose import config_dir
from ddptrain.config.schema import Config

USAGE = """\
usage: ddptrain [OPTIONS] [OVERRIDES...]
       torchrun --nproc-per-node=N -m ddptrain [OPTIONS] [OVERRIDES...]

Data-parallel training of language models. Overrides are Hydra's: key=value, group=choice,
+experiment=NAME (an overlay), ~key (delete).

options:
  -h, --help                 this text
  --cfg {job,hydra,all}      print the composed config and exit
  --resolve                  with --cfg: resolve interpolations
  -m, --multirun             sweep through Hydra's sweeper and launcher plugins: a=1,2 b=range(1,4)
                             c=choice(x,y) runs the cartesian product (hydra/sweeper=basic), one job after
                             another, each a full launch with its own workers (hydra/launcher=ddptrain), in
                             multirun/DATE/TIME/N (or hydra.sweep.dir=DIR); hydra/sweeper=optuna with
                             'optim.lr=interval(1e-4,3e-3)' searches sweep.objective; writes sweep.md/.csv/.png
  --fail-fast                with -m: stop at the first failed job (default: report it and go on)
  -cd, --config-dir DIR      a directory of config groups laid over ours: DIR/experiment/mine.yaml is
                             +experiment=mine, DIR/model/my7b.yaml is model=my7b (same name: yours wins)
  -cn, --config-name NAME    the primary config (default: config; yours may live in --config-dir)
  hydra.searchpath=[file://DIR,pkg://module]
                             more config directories, searched after ours
"""


def config_groups(dirs: list[Path]) -> dict[str, list[str]]:
    """Group name (``parallel``, ``parallel/compression``) -> its choices, over every config directory."""
    groups: dict[str, set[str]] = {}
    for root in dirs:
        for path in root.rglob("*.yaml"):
            group = path.parent.relative_to(root).as_posix()
            if group != ".":
                groups.setdefault(group, set()).add(path.stem)
    return {g: sorted(groups[g]) for g in sorted(groups)}


def primary_configs(dirs: list[Path]) -> list[str]:
    return sorted({p.stem for root in dirs for p in root.glob("*.yaml")})


def _type_name(tp: typing.Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "|".join(m.value for m in tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def schema_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, default) for every leaf of the schema."""
    hints = typing.get_type_hints(cls)
    instance = cls()
    keys: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(tp):
            keys += schema_keys(tp, f"{prefix}{f.name}.")
            continue
        default = value.value if isinstance(value, enum.Enum) else value
        keys.append((f"{prefix}{f.name}", _type_name(tp), "null" if default is None else str(default)))
    return keys


def help_text(user_dir: Path | None) -> str:
    dirs = [d for d in (user_dir, config_dir()) if d is not None]
    lines = [USAGE, "config groups (group=choice; experiment and parallel/* with a leading +):"]
    for group, choices in config_groups(dirs).items():
        lines.append(f"  {group + ':':<22} {', '.join(choices)}")
    lines += ["", f"primary configs (-cn): {', '.join(primary_configs(dirs))}", "",
              "installed Hydra plugins for -m (hydra/sweeper=NAME, hydra/launcher=NAME):",
              f"  {'hydra/sweeper:':<22} {', '.join(installed('hydra/sweeper'))}",
              f"  {'hydra/launcher:':<22} {', '.join(installed('hydra/launcher'))}", "",
              "keys (key: type = schema default; the chosen group files set many of them):"]
    lines += [f"  {key}: {tp} = {default}" for key, tp, default in schema_keys()]
    lines += ["", "examples:",
              "  ddptrain +experiment=quickstart",
              "  ddptrain -m parallel.bucket_cap_mb=1,5,25 +experiment=quickstart train.steps=40",
              "  ddptrain -m hydra/sweeper=optuna hydra.sweeper.n_trials=8 'optim.lr=interval(1e-4,3e-3)' "
              "+experiment=quickstart",
              "  ddptrain launch.dry_run=true +experiment=gpt2_small plan.world_size=8",
              "  ddptrain +experiment=quickstart ft.replica_groups=2 launch.nproc_per_node=1  "
              "# torchft replica groups (pip install 'ddptrain[ft]')",
              "  torchrun --nproc-per-node=8 -m ddptrain +experiment=gpt2_small parallel.bucket_cap_mb=50"]
    return "\n".join(lines)
