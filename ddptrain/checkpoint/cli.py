"""``ddptrain-ckpt`` (or ``python -m ddptrain.checkpoint``): inspect, export and verify checkpoints offline.

One CPU process, no torchrun: ``info PATH [overrides]``, ``export PATH OUT [--overwrite]``, ``verify PATH``,
``convert PATH --trust``. PATH is a checkpoint directory or a run directory (its latest committed checkpoint).
Nothing here runs code from a checkpoint, except ``convert --trust``, which exists to rewrite a trusted
checkpoint of an earlier ddptrain in the plain types every other command reads.
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
    info = commands.add_parser("info", help="step, strategy, world size, parameters, data position, and how the "
                               "checkpoint's config differs from its run's (config.yaml), with overrides on top")
    info.add_argument("path", type=Path)
    info.add_argument("overrides", nargs="*", help="key=value overrides of the run's config to diff against "
                      "(e.g. data.global_batch_size=16)")
    export = commands.add_parser("export", help="save_pretrained the model (and tokenizer) into OUT")
    export.add_argument("path", type=Path)
    export.add_argument("out", type=Path)
    export.add_argument("--overwrite", action="store_true", help="write into OUT even if it is a non-empty directory")
    verify = commands.add_parser("verify", help="load every tensor; check its shape against the model and finiteness")
    verify.add_argument("path", type=Path)
    convert = commands.add_parser("convert", help="rewrite an earlier version's trainer.pt and RNG files in plain "
                                  "types (runs their pickles: only for a checkpoint you trust)")
    convert.add_argument("path", type=Path)
    convert.add_argument("--trust", action="store_true", required=True,
                         help="required: you trust where this checkpoint came from")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    from ddptrain.checkpoint import offline

    try:
        if args.command == "info":
            print("\n".join(offline.info(args.path, args.overrides)))
        elif args.command == "export":
            used = offline.export(args.path, args.out, args.overwrite)
            print(f"exported {used} to {args.out}, read back and equal to the checkpoint (load it with "
                  "AutoModelForCausalLM.from_pretrained)")
        elif args.command == "convert":
            used, rewritten = offline.convert(args.path)
            print(f"{used}: rewrote {', '.join(p.name for p in rewritten) or 'nothing'} in plain types")
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


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(sys.argv[1:]))
