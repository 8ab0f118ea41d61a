"""The ``ddptrain`` command: compose the config, then print it, plan, sweep, launch workers, or train here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddptrain.compose import job_config, register_schema
from ddptrain.errors import ConfigError, ResourceError, RunEnded, one_line

ERROR_GRACE_S = 3.0
PRIMARY = "config"
log = logging.getLogger("ddptrain")


def config_dir() -> Path:
    """The config groups: shipped inside the package (``pip install .``, Docker), else the checkout's ``configs/``."""
    installed = Path(__file__).parent / "configs"
    return installed if installed.is_dir() else Path(__file__).parents[1] / "configs"


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ddptrain", add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--cfg", choices=["job", "hydra", "all"])
    parser.add_argument("--resolve", action="store_true")
    parser.add_argument("-m", "--multirun", action="store_true")
    parser.add_argument("--fail-fast", action="store_true")
    parser.add_argument("-cd", "--config-dir", type=Path)
    parser.add_argument("-cn", "--config-name", default=PRIMARY)
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def source_of(args: argparse.Namespace) -> Source:
    user_dir = args.config_dir.absolute() if args.config_dir else None
    if user_dir is not None and not user_dir.is_dir():
        raise ConfigError(f"--config-dir {args.config_dir}: no such directory")
    return Source(user_dir, args.config_name, list(args.overrides))


@contextmanager
def hydra_search_path(source: Source) -> Iterator[None]:
    """Hydra initialised on our config groups, with the user's directory first (as Hydra apps treat -cd)."""
    GlobalHydra.instance().clear()
    search_path = create_config_search_path(str(config_dir()))
    if source.user_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{source.user_dir}")
    Hydra.create_main_hydra2(task_name="ddptrain", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


def compose_config(source: Source | list[str], multirun: bool = False) -> DictConfig:
    """The composed config with its ``hydra`` node, checked against the schema (one-line errors).

    ``multirun``: sweep overrides (``a=1,2``) are left for the sweep; the rest composes as usual.
    """
    if isinstance(source, list):
        source = Source(overrides=source)
    register_schema()
    try:
        with hydra_search_path(source):
            cfg = GlobalHydra.instance().config_loader().load_configuration(
                config_name=source.name, overrides=source.overrides,
                run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN,
            )
        HydraConfig.instance().set_config(cfg)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    return cfg


def print_config(cfg: DictConfig, which: str, resolve: bool) -> None:
    node = cfg if which == "all" else (OmegaConf.masked_copy(cfg, ["hydra"]) if which == "hydra" else job_config(cfg))
    print(OmegaConf.to_yaml(node, resolve=resolve), end="")


def say(line: str) -> None:
    """One line to stderr in a single write: lines of ranks sharing a pipe never interleave (print writes the
    text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_cli(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        source = source_of(args)
        if args.help:
            from ddptrain.help import help_text

            print(help_text(source.user_dir))
            return 0
        if args.multirun:
            from ddptrain.sweep import run_sweep

            return run_sweep(source, compose_config(source, multirun=True), fail_fast=args.fail_fast)
        cfg = compose_config(source)
        if args.cfg:
            print_config(cfg, args.cfg, args.resolve)
            return 0
        from ddptrain import launch

        run = launch.typed_config(cfg)
        if run.typed.launch.dry_run:
            return launch.dry_run(run)
        if not launch.is_worker() and run.typed.launch.nproc_per_node > 1:
            return launch.launch_workers(run, source.argv())
        return launch.run_worker(run)
    except RunEnded as exc:
        say(f"ddptrain: {exc}")
        return exc.exit_code
    except (ConfigError, ResourceError) as exc:
        say(f"ddptrain: error: {exc}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # The elastic agent stops every worker as soon as one exits: give the peers, which fail the same
            # way, time to print their own line before this rank's exit triggers that.
            time.sleep(ERROR_GRACE_S)
        return 2 if isinstance(exc, ConfigError) else 1


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(sys.argv[1:]))
