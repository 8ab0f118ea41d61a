"""Tokens/s and MFU on one CUDA device: gpt2_small and llama_1b, bf16 autocast, eager against compiled blocks.

Also the evidence that a steady step does not stall: every run trains under
``torch.cuda.set_sync_debug_mode("warn")``, and the synchronizing CUDA calls are counted per step, for steady
steps apart from check, logging and checkpoint steps. Run it through ``scripts/bench_gpu.sh``; with ``--write``
the table replaces the block between the ``bench_gpu`` markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ddptrain.config.compose import build_config
from ddptrain.runtime.process_group import DistEnv
from ddptrain.telemetry.metrics import StepMetrics
from ddptrain.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # model preset -> (sequence length, micro batch): one H100 80GB, no activation checkpointing
    "gpt2_small": (1024, 16),
    "llama_1b": (2048, 4),
}
MARK_BEGIN, MARK_END = "<!-- bench_gpu:begin -->", "<!-- bench_gpu:end -->"


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text in sync debug mode "warn"


class SyncCounter:
    """Synchronizing CUDA calls per training step, from the warnings of ``torch.cuda.set_sync_debug_mode``.

    Only torch's synchronizing-operation warning counts; any other warning is shown as usual once the run ends.
    ``StepMetrics.start_step`` is wrapped while the counter is entered, and restored on exit, so a second run
    counts its own steps and nothing of the first one's.
    """

    def __init__(self) -> None:
        self.per_step: dict[int, int] = {}
        self._caught: list[warnings.WarningMessage] = []
        self._step, self._seen = 0, 0

    def _close(self) -> None:
        syncs = [w for w in self._caught[self._seen:] if str(w.message) == SYNC_WARNING]
        self.per_step[self._step] = len(syncs)
        self._seen = len(self._caught)

    def __enter__(self) -> SyncCounter:
        start_step = self._start_step = StepMetrics.start_step

        def mark(meter: StepMetrics, step: int) -> None:
            self._close()
            self._step = step
            start_step(meter, step)

        StepMetrics.start_step = mark  # type: ignore[method-assign]
        self._context = warnings.catch_warnings(record=True)
        self._caught = self._context.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)  # every one, not once per call site
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()
        torch.cuda.set_sync_debug_mode("default")
        self._context.__exit__(*exc)
        StepMetrics.start_step = self._start_step  # type: ignore[method-assign]
        for w in self._caught:
            if str(w.message) != SYNC_WARNING:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def run(name: str, compiled: bool, args: argparse.Namespace, env: DistEnv, out: Path) -> dict[str, Any]:
    seq_len, micro = MODELS[name]
    model = OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")
    cfg = build_config(
        {"model": model},
        {"data": {"source": "synthetic", "vocab_size": model.vocab_size, "num_samples": 4 * micro * args.steps,
                  "seq_len": seq_len, "global_batch_size": micro, "micro_batch_size": micro,
                  "cache_dir": str(out / "cache")},
         "train": {"steps": args.steps, "log_every": args.window, "check_every": args.window, "eval_every": 0,
                   "compile": compiled},
         "metrics": {"sample_every": 10**9},  # no step-breakdown timing: it synchronizes on CUDA
         "logger": {"progress": False, "jsonl": False},
         "checkpoint": {"export": False}},
    )
    run_dir = out / f"{name}-{'compiled' if compiled else 'eager'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # transformers' blocks of every model share one forward function: without a reset a later run would reuse
    # (or be refused, past the recompile limit) what an earlier run compiled, and its compile time would lie.
    torch.compiler.reset()
    with SyncCounter() as syncs:
        summary = train(cfg, env, torch.device("cuda", env.local_rank), run_dir, {})
    special = {1, args.steps} | {s for s in range(1, args.steps + 1) if s % args.window == 0}
    steady = [n for s, n in syncs.per_step.items() if s not in special and s > 0]
    checks = [n for s, n in syncs.per_step.items() if s in special - {1, args.steps}]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final save: GBs for llama_1b
    torch.cuda.empty_cache()
    return {"summary": summary, "steady_syncs": max(steady, default=0), "steady_steps": len(steady),
            "check_syncs": max(checks, default=0)}


def table(results: dict[tuple[str, bool], dict[str, Any]], device: str, args: argparse.Namespace) -> str:
    lines = [
        f"{device}, 1 rank, bf16 autocast, {args.steps} steps (windows of {args.window}; median after the first)",
        "",
        "| model | mode | tokens/s | MFU | step (ms) | compile (s) | syncs per steady step | syncs per check step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, compiled), r in results.items():
        s = r["summary"]
        compile_s = f"{s['compile_s']:.0f}" if "compile_s" in s else "-"
        lines.append(f"| {name} | {'compiled' if compiled else 'eager'} | {s['tokens_per_s']:,.0f} "
                     f"| {s.get('mfu_pct', float('nan')):.1f}% | {s['step_time_s'] * 1e3:.0f} | {compile_s} "
                     f"| {r['steady_syncs']} (of {r['steady_steps']} steps) | {r['check_syncs']} |")
    return "\n".join(lines)


def write(doc: Path, block: str) -> None:
    text = doc.read_text()
    begin, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    doc.write_text(text[:begin] + "\n" + block + "\n" + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--write", type=Path, help="the benchmarks document whose bench_gpu block to replace")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device")
    dist.init_process_group("nccl")
    env = DistEnv.from_environ()
    logging.basicConfig(level=logging.WARNING)
    out = Path(tempfile.gettempdir()) / "ddptrain-bench-gpu"
    results = {(name, compiled): run(name, compiled, args, env, out)
               for name in args.models for compiled in (False, True)}
    block = table(results, torch.cuda.get_device_name(), args)
    print(block)
    if args.write:
        write(args.write, block)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
