"""The ``ddptrain`` command: compose the config, then plan, launch workers, or train in this process."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddptrain.config import job_config, register_schema
from ddptrain.errors import ConfigError, RunEnded, one_line

ERROR_GRACE_S = 3.0
log = logging.getLogger("ddptrain")


def config_dir() -> Path:
    """The config groups: shipped inside the package (``pip install .``, Docker), else the checkout's ``configs/``."""
    installed = Path(__file__).parent / "configs"
    return installed if installed.is_dir() else Path(__file__).parents[1] / "configs"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ddptrain",
        description="Data-parallel training of language models. Overrides are Hydra's: key=value, group=choice, "
        "+experiment=NAME.",
        epilog="Under torchrun: torchrun --nproc-per-node=8 -m ddptrain +experiment=gpt2_small",
    )
    parser.add_argument("--cfg", choices=["job", "hydra", "all"], help="print the composed config and exit")
    parser.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel.bucket_cap_mb=50")
    return parser.parse_args(argv)


def compose_config(overrides: list[str]) -> DictConfig:
    """The composed config with its ``hydra`` node, checked against the schema (one-line errors)."""
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None, job_name="ddptrain"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        OmegaConf.to_container(job_config(cfg), resolve=True, throw_on_missing=True)  # bad interpolations
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
        cfg = compose_config(args.overrides)
        if args.cfg:
            print_config(cfg, args.cfg, args.resolve)
            return 0
        from ddptrain import launch

        if cfg.launch.dry_run:
            return launch.dry_run(cfg)
        if not launch.is_worker() and cfg.launch.nproc_per_node > 1:
            return launch.launch_workers(cfg, args.overrides)
        return launch.run_worker(cfg)
    except RunEnded as exc:
        say(f"ddptrain: {exc}")
        return exc.exit_code
    except ConfigError as exc:
        say(f"ddptrain: error: {exc}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # The elastic agent stops every worker as soon as one exits: give the peers, which fail the same
            # way, time to print their own line before this rank's exit triggers that.
            time.sleep(ERROR_GRACE_S)
        return 2


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(sys.argv[1:]))
