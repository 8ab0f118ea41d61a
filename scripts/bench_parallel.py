"""Step time and model-state memory per ZeRO stage and per gradient compression, as ratios to DDP.

Runs every variant through the real training loop inside one torchrun job, interleaved over repeats
(A B C ... A B C ...), and reports medians, so machine noise hits every variant alike:

    torchrun --standalone --nproc-per-node=2 scripts/bench_parallel.py --repeats 3 --steps 12
    torchrun --standalone --nproc-per-node=2 scripts/bench_parallel.py --suite telemetry --repeats 7
    torchrun --standalone --nproc-per-node=1 scripts/bench_parallel.py --suite single --repeats 7

``--suite telemetry`` measures what the step-breakdown timing costs: every step timed, the default sampling
(every step on CPU, every 10th on CUDA), and none. With CUDA present each rank trains on cuda:LOCAL_RANK over NCCL.
``--suite optim`` compares AdamW's kernels (``optim.impl``); ``--suite compile`` eager against ``train.compile``.
``--suite single`` (one rank) measures what a wrapper costs where there is nothing to synchronise: the bare
model against DDP, our bucketed engine and FSDP2, each forced on with ``parallel.wrap_single``.
Every suite's first variant is the reference of its ratios.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.runtime.process_group import DistEnv
from ddptrain.train.trainer import train

SUITES: dict[str, dict[str, dict[str, dict]]] = {  # suite -> variant -> config section -> overrides
    "strategies": {
        "DDP (stage 0)": {},
        "ZeRO-1": {"parallel": {"zero_stage": 1}},
        "ZeRO-2": {"parallel": {"zero_stage": 2}},
        "ZeRO-3": {"parallel": {"zero_stage": 3}},
        "fp16": {"parallel": {"compression": "fp16"}},
        "bf16": {"parallel": {"compression": "bf16"}},
        "powersgd r=4": {"parallel": {"compression": "powersgd", "powersgd_rank": 4, "powersgd_start_iter": 2}},
        "topk 1%": {"parallel": {"compression": "topk", "topk_ratio": 0.01}},
    },
    "telemetry": {
        "DDP (stage 0)": {"metrics": {"sample_every": 10**9}},  # the breakdown timer never runs
        "default sampling": {"metrics": {"sample_every": None}},
        "timed every step": {"metrics": {"sample_every": 1}},
    },
    "single": {
        "bare model": {},
        "torch DDP": {"parallel": {"wrap_single": True}},
        "bucketed engine": {"parallel": {"wrap_single": True, "engine": "bucketed"}},
        "FSDP2 (ZeRO-3)": {"parallel": {"wrap_single": True, "zero_stage": 3}},
    },
    "optim": {  # AdamW's kernel; the default (auto) is fused on CPU
        "fused (auto)": {},
        "foreach": {"optim": {"impl": "foreach"}},
        "for_loop": {"optim": {"impl": "for_loop"}},
    },
    "compile": {  # eager against compiled blocks; compilation is reported apart, out of the step time
        "eager": {},
        "compiled blocks": {"train": {"compile": True}},
    },
}


def config(steps: int, out: Path, overrides: dict[str, dict]) -> Config:
    base = {
        "data": {"max_documents": 300, "seq_len": 128, "global_batch_size": 16, "micro_batch_size": 8,
                 "cache_dir": str(out / "cache")},
        "train": {"steps": steps, "log_every": 2, "eval_every": 0},
        "logger": {"progress": False, "jsonl": False},
        "checkpoint": {"export": False},
    }
    return build_config(base, overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--suite", choices=sorted(SUITES), default="strategies")
    args = parser.parse_args()
    env = DistEnv.from_environ()
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    logging.basicConfig(level=logging.WARNING)
    out = Path(tempfile.gettempdir()) / "ddptrain-bench-parallel"
    variants = SUITES[args.suite]
    times: dict[str, list[float]] = {name: [] for name in variants}
    state: dict[str, dict] = {}
    comm: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, overrides in variants.items():
            run_dir = out / name.replace(" ", "_")
            if env.is_main:
                shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run dir per repeat
            dist.barrier()
            run_dir.mkdir(parents=True, exist_ok=True)
            summary = train(config(args.steps, out, overrides), env, device, run_dir, {})
            times[name].append(summary["step_time_s"])
            state[name] = summary["model_state"]
            comm[name] = summary.get("comm_bytes", float("nan"))
            if "compile_s" in summary and env.is_main:
                print(f"{name}: first step {summary['compile_s']:.1f} s, compilation included", flush=True)
    if env.is_main:
        print(report(times, state, comm, args))
    dist.barrier()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], state: dict[str, dict], comm: dict[str, float],
           args: argparse.Namespace) -> str:
    first = next(iter(times))  # the reference variant of the suite
    base_t = statistics.median(times[first])
    base_m = _max_total(state[first])
    lines = [
        f"world size {dist.get_world_size()}, {args.repeats} interleaved repeats x {args.steps} steps, medians",
        "",
        f"| variant | step time (ms) | vs {first} | model state / rank (MiB, max over ranks) | vs {first} "
        f"| formula (MiB) | gradient bytes sent / step / rank | vs {first} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in times:
        t = statistics.median(times[name])
        m = _max_total(state[name])
        formula = sum(state[name]["formula_bytes"].values()) / 2**20
        sent = comm[name]
        base_sent = comm[first]
        if sent != sent:  # NaN: no gradient sync measured (FSDP2, or a bare model with nothing to send)
            sent_cells = "not measured | -"
        elif base_sent != base_sent:
            sent_cells = f"{sent / 2**20:.3f} MiB | -"
        else:
            sent_cells = f"{sent / 2**20:.3f} MiB | {sent / base_sent:.3f}x"
        lines.append(f"| {name} | {t * 1e3:.0f} | {t / base_t:.2f}x | {m / 2**20:.2f} | {m / base_m:.2f}x "
                     f"| {formula:.2f} | {sent_cells} |")
    return "\n".join(lines)


def _max_total(model_state: dict) -> float:
    return max(sum(rank.values()) for rank in model_state["measured_bytes_per_rank"])


if __name__ == "__main__":
    main()
