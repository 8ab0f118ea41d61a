"""The ``ddptrain`` command: compose the config, then print it, plan, sweep, launch workers, or train here."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddptrain.app.said import first_to_say
from ddptrain.app.settled import record_settled, settled_before
from ddptrain.config.choices import Launcher
from ddptrain.config.compose import PRIMARY, Source, compose_config, job_config, typed_config
from ddptrain.errors import ConfigError, PeerLost, QuorumLost, ResourceError, RunEnded, say
from ddptrain.ft.layout import GROUP_AGENT_ENV
from ddptrain.runtime.allocator import use_expandable_segments

ERROR_GRACE_S = 3.0
log = logging.getLogger("ddptrain")


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


def print_config(cfg: DictConfig, which: str, resolve: bool) -> None:
    node = cfg if which == "all" else (OmegaConf.masked_copy(cfg, ["hydra"]) if which == "hydra" else job_config(cfg))
    print(OmegaConf.to_yaml(node, resolve=resolve), end="")


def run_cli(argv: list[str]) -> int:
    args = parse_args(argv)
    if (settled := settled_before()) is not None:  # an earlier attempt of this launch refused or aborted: said once
        return settled
    code = _run_cli(args)
    record_settled(code)
    return code


def _run_cli(args: argparse.Namespace) -> int:
    try:
        source = source_of(args)
        if args.help:
            from ddptrain.app.help import help_text

            print(help_text(source.user_dir))
            return 0
        if args.multirun:
            from ddptrain.app.sweep import run_sweep

            return run_sweep(source, fail_fast=args.fail_fast)
        cfg = compose_config(source)
        if args.cfg:
            print_config(cfg, args.cfg, args.resolve)
            return 0
        run = typed_config(cfg)  # the schema's checks, before the launch module's imports
        if run.typed.ft.replica_groups > 0:  # replica groups (torchft): its own launcher; a group in its own dir
            from ddptrain.ft.extra import require_torchft
            from ddptrain.ft.layout import in_group

            require_torchft(run.typed.ft.replica_groups)  # one line without the extra, before anything starts
            run = in_group(run)
            if not run.typed.launch.dry_run and run.typed.ft.replica_id is None and "LOCAL_RANK" not in os.environ:
                from ddptrain.app.ft_launch import launch_groups

                return launch_groups(run, source.argv())
        from ddptrain.app import launch

        if run.typed.launch.dry_run:
            return launch.dry_run(run)
        if not launch.is_worker() and run.typed.launch.backend == Launcher.ray:
            from ddptrain.app.ray_launch import launch_ray

            return launch_ray(run, source)
        if not launch.is_worker() and (run.typed.launch.nproc_per_node > 1 or launch.operator_pod()
                                       or run.typed.ft.replica_id is not None):  # a replica group: its own agent
            return launch.launch_workers(run, source.argv())
        launch.run_worker(run)
        return 0
    except PeerLost as exc:  # each rank says what it waited in; the launcher names who is at fault
        say(f"ddptrain: {exc}")
        return exc.exit_code
    except QuorumLost as exc:
        if GROUP_AGENT_ENV not in os.environ:  # a group with no groups' launcher above it (a pod of its own)
            say_once(f"ddptrain: {exc}")
        return exc.exit_code  # else the groups' launcher says whether the run stops, or restarts this group
    except RunEnded as exc:
        say_once(f"ddptrain: {exc}")
        return exc.exit_code
    except (ConfigError, ResourceError) as exc:
        say_once(f"ddptrain: error: {exc}")
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt as exc:  # Ctrl-C outside the training loop (which stops at a check step, checkpoints)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent passes the signal on: this line is not cut short
        from ddptrain.runtime.starting import interrupted_line

        say_once(f"ddptrain: {interrupted_line(exc)}", grace_s=0.0)
        return 130


def say_once(line: str, grace_s: float | None = None) -> None:
    """A worker's last line, printed once for the job: at once on rank 0; on another rank only after ``grace_s``,
    by when the elastic agent has stopped it if rank 0 ended the same way (every rank decides these alike), so
    a line that only that rank has is still printed. ``grace_s`` 0: only rank 0 prints (a Ctrl-C reaches every
    rank at once). A replica group's worker says it only if no other group of the launch said it already
    (``app/said.py``)."""
    grace_s = ERROR_GRACE_S if grace_s is None else grace_s
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        if grace_s <= 0:
            return
        # the agent's stop while waiting ends this rank quietly, leaving no hang evidence: nothing hung
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(grace_s)
    if first_to_say(line):
        say(line)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    use_expandable_segments(os.environ)  # before anything starts CUDA's allocator; torchrun's workers inherit it
    exit_code: list[int] = []
    atexit.register(end_without_teardown, exit_code)  # registered first, so it runs after every other handler
    exit_code.append(run_cli(sys.argv[1:]))
    sys.exit(exit_code[0])


def end_without_teardown(exit_code: list[int]) -> None:
    """End the process once every exit handler has run (logging, W&B, multiprocessing, temporary files), without
    the interpreter's teardown of every module: with torch and transformers loaded that teardown is a second or
    more of garbage collection in every rank of every run (and in the launcher), and it has nothing left to do —
    our files are closed and the process group is destroyed by then. After an exception escaped ``main`` no code
    was recorded and Python ends as usual. The one handler registered before this one is logging's (imported with
    this module), so it is called here."""
    if not exit_code:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            stream.flush()
    os._exit(exit_code[0])
