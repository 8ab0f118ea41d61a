"""``ddptrain-ckpt`` (or ``python -m ddptrain.checkpoint``): inspect, export and verify checkpoints offline.

One CPU process, no torchrun: ``info PATH [overrides]``, ``export PATH OUT``, ``verify PATH``. PATH is a
checkpoint directory or a run directory (its latest committed checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddptrain.errors import ConfigError, one_line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ddptrain-ckpt", description="Inspect, export and verify ddptrain "
                                     "checkpoints on one CPU process.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="step, strategy, world size, parameters, data position, config diff")
    info.add_argument("path", type=Path)
    info.add_argument("overrides", nargs="*", help="Hydra overrides of the config to diff against (as for ddptrain)")
    export = commands.add_parser("export", help="save_pretrained the model (and tokenizer) into OUT")
    export.add_argument("path", type=Path)
    export.add_argument("out", type=Path)
    verify = commands.add_parser("verify", help="load every tensor; check its shape against the model and finiteness")
    verify.add_argument("path", type=Path)
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    from ddptrain.checkpoint import offline

    try:
        if args.command == "info":
            print("\n".join(offline.info(args.path, _config_now(args.overrides))))
        elif args.command == "export":
            used = offline.export(args.path, args.out)
            print(f"exported {used} to {args.out} (load it with AutoModelForCausalLM.from_pretrained)")
        else:
            used, problems, count = offline.verify(args.path)
            for problem in problems:
                print(f"{used}: {problem}")
            if problems:
                return 1
            print(f"{used}: {count} tensors read; shapes match the model, all values finite")
    except ConfigError as exc:
        print(f"ddptrain-ckpt: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        print(f"ddptrain-ckpt: error: {args.path}: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def _config_now(overrides: list[str]):
    """The config a run with these overrides would use now, typed (what ``info`` diffs the checkpoint against)."""
    from ddptrain.cli import compose_config
    from ddptrain.launch import typed_config

    return typed_config(compose_config(overrides)).typed


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(sys.argv[1:]))
