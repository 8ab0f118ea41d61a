"""Scaling sweep: the same ddptrain run at several world sizes, as a table (markdown + CSV), a plot and a W&B table.

A preset over ``ddptrain -m``'s job runner (``ddptrain/app/sweep.py``): each size is one job of it, with the
world size and, for weak scaling, the global batch set per job; this script adds speed-up and efficiency.

    python scripts/scaling.py --sizes 1 2 --out docs/ -- +experiment=quickstart train.steps=60 train.eval_every=0

The table, CSV and plot go to ``--out``, by default the runs' directory (``--runs``, else
``outputs/scaling/<date_time>``); the last line names the three files by their full paths.

Each size N is one ``python -m ddptrain launch.nproc_per_node=N ...`` (the product's own launcher) in a run
directory of its own; its ``summary.json`` gives ``tokens_per_s`` (global tokens/s, median over the steady
windows). ``--mode weak`` (the default) holds the work of each rank fixed: the global batch grows with N
(``data.global_batch_size`` x N / smallest N), which is what "DDP scaling efficiency" means: how much of an
extra device's throughput survives the gradient all-reduce. ``--mode strong`` holds the global batch fixed, so
each rank's share (micro-batches per step) shrinks as N grows. Speed-up and efficiency are relative to the
smallest N of the sweep (N=1 when it is in the sweep): efficiency = tps_N x N_min / (N x tps_min).

On CPU every rank gets the same number of threads at every N (cores / largest N, unless OMP_NUM_THREADS is
set), so a rank owns a fixed share of the machine as it would own one GPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from ddptrain.app.sweep_job import job_env, run_job
from ddptrain.config.compose import compose_config
from ddptrain.errors import ConfigError, flat

# summary.json keys shown when the runs report them, with their markdown headers
OPTIONAL_KEYS = {
    "step_time_s": "step (s)", "time_exposed_comm_s": "exposed comm (s)", "comm_time_s": "comm in flight (s)",
    "overlap_pct": "overlap %", "busbw_gbps": "busbw (GB/s)", "tflops_per_rank": "TFLOP/s per rank",
    "mfu_pct": "MFU %",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run one ddptrain experiment at several world sizes; write scaling.md/.csv/.png.",
        epilog="Everything after -- goes to ddptrain as Hydra overrides, e.g. -- +experiment=quickstart train.steps=60",
    )
    parser.add_argument("--sizes", type=int, nargs="+", help="world sizes (default: 1, 2, 4... up to the number of "
                        "CUDA devices, or of CPU cores without CUDA)")
    parser.add_argument("--mode", choices=["weak", "strong"], default="weak",
                        help="weak: fixed work per rank, global batch x N (default); strong: fixed global batch")
    parser.add_argument("--out", type=Path, help="where scaling.md, .csv and .png go (default: the runs' directory, "
                        "--runs)")
    parser.add_argument("--runs", type=Path, help="where the runs go (default: outputs/scaling/<date_time>)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the sweep this many times, sizes interleaved; the table holds the fastest runs")
    parser.add_argument("--wandb", action="store_true", help="log the table and plot to W&B (also with logger=wandb)")
    parser.add_argument("overrides", nargs="*", help="ddptrain overrides (after --)")
    args = parser.parse_args(argv)
    args.sizes = sorted(set(args.sizes or default_sizes()))
    if min(args.sizes) < 1 or args.repeats < 1:
        parser.error("sizes and --repeats must be positive")
    return args


def default_sizes() -> list[int]:
    """Powers of two up to the CUDA devices on this machine, or up to its cores without CUDA."""
    limit = torch.cuda.device_count() or os.cpu_count() or 1
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def global_batch(mode: str, base: int, size: int, smallest: int) -> int:
    """The global batch of the run at ``size``: the configured one (strong), or scaled with N (weak)."""
    if mode == "strong":
        return base
    if base * size % smallest:
        raise ValueError(f"weak scaling: data.global_batch_size={base} x {size} / {smallest} is not a whole number")
    return base * size // smallest


def child_env(sizes: list[int]) -> dict[str, str]:
    """The runs' environment; on CPU, one fixed share of the cores per rank at every size."""
    env = job_env()
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(sizes))))
    return env


def run_one(size: int, batch: int, run_dir: Path, overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Train at world size ``size`` as one job of the product's sweep runner; its summary.json, or RuntimeError
    with the job's error line."""
    job = [*overrides, f"launch.nproc_per_node={size}", f"data.global_batch_size={batch}"]
    print(f"N={size}: {shlex.join(['ddptrain', *job])}", file=sys.stderr, flush=True)
    result = run_job(size, [], job, run_dir, env)
    if not result.ok:
        raise RuntimeError(result.error)
    if not result.summary.get("tokens_per_s"):
        raise RuntimeError("summary.json holds no tokens_per_s (too few logged steps?)")
    return result.summary


def tabulate(summaries: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per size from its fastest run (other jobs on a machine only ever slow a run down, so the fastest
    repeat is the closest to what the hardware does), the slowest for the spread, and speed-up and efficiency
    against the smallest size."""
    rows = []
    for size in sorted(summaries):
        runs = summaries[size]
        best = max(runs, key=lambda s: s["tokens_per_s"])
        row: dict[str, Any] = {
            "model": best["model"], "world_size": size, "runs": len(runs),
            "global_batch_size": best["global_batch_size"], "grad_accum": best["grad_accum"],
            "tokens_per_s": best["tokens_per_s"], "tokens_per_s_slowest": min(s["tokens_per_s"] for s in runs),
            "tokens_per_s_per_rank": best["tokens_per_s"] / size,
            **{key: best[key] for key in OPTIONAL_KEYS if best.get(key) is not None},
        }
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["efficiency"] = row["speedup"] * base["world_size"] / row["world_size"]
    return rows


def columns(rows: list[dict[str, Any]]) -> list[str]:
    fixed = ["model", "world_size", "runs", "global_batch_size", "grad_accum", "tokens_per_s",
             "tokens_per_s_slowest", "tokens_per_s_per_rank", "speedup", "efficiency"]
    return fixed + [k for k in OPTIONAL_KEYS if any(k in row for row in rows)]


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    extra = [k for k in OPTIONAL_KEYS if any(k in row for row in rows)]
    header = ["N", "global batch", "grad accum", "tokens/s", "slowest run", "tokens/s per rank", "speed-up",
              "efficiency", *(OPTIONAL_KEYS[k] for k in extra)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        cells = [str(r["world_size"]), str(r["global_batch_size"]), str(r["grad_accum"]), f"{r['tokens_per_s']:,.0f}",
                 f"{r['tokens_per_s_slowest']:,.0f}", f"{r['tokens_per_s_per_rank']:,.0f}",
                 f"{r['speedup']:.2f}×", f"{r['efficiency']:.0%}"]
        cells += [f"{r[k]:.3g}" if k in r else "–" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reading(rows: list[dict[str, Any]], mode: str, repeats: int, env: dict[str, str], load: float) -> str:
    """A factual paragraph: what was held fixed, what came out, on what hardware, and how far to trust it."""
    base, last = rows[0], rows[-1]
    held = ("the work of each rank (global batch grows with N, micro-batches per rank per step fixed)"
            if mode == "weak" else "the global batch (each rank's share shrinks as N grows)")
    if torch.cuda.is_available():
        hardware = f"one {torch.cuda.get_device_name()} per rank"
    else:
        hardware = (f"CPU, {env.get('OMP_NUM_THREADS', '?')} thread(s) per rank on a {os.cpu_count()}-core machine "
                    f"(load average {load:.1f} when the sweep started); gloo's communication threads share those "
                    "cores with the training threads, so these figures say little about the same run on GPUs, "
                    "where compute is far faster and NCCL runs on a stream of its own")
    text = f"{mode.capitalize()} scaling: the sweep held {held}. "
    if len(rows) == 1:
        text += f"Only N={base['world_size']} produced a summary, so there is no scaling to read. "
    else:
        text += (f"Going from N={base['world_size']} to N={last['world_size']} multiplied global throughput by "
                 f"{last['speedup']:.2f}× against an ideal of {last['world_size'] / base['world_size']:.0f}×, a "
                 f"scaling efficiency of {last['efficiency']:.0%} (relative to N={base['world_size']}). ")
        if mode == "weak" and all("step_time_s" in r for r in (base, last)) and "time_exposed_comm_s" in last:
            text += (f"A step took {last['step_time_s'] - base['step_time_s']:.3f} s longer at N={last['world_size']} "
                     f"than at N={base['world_size']}; gradient communication left exposed after backward accounts "
                     f"for {last['time_exposed_comm_s'] - base.get('time_exposed_comm_s', 0.0):.3f} s of that. ")
    text += f"Hardware: {hardware}. "
    if repeats > 1:
        spread = max(1 - r["tokens_per_s_slowest"] / r["tokens_per_s"] for r in rows)
        text += (f"Each size ran {repeats} times, sizes interleaved; the table gives each size's fastest run, since "
                 "other jobs on the machine only ever slow a run down. The slowest run of a size was up to "
                 f"{spread:.0%} below its fastest: that is how much the machine's other load moved these numbers.")
    else:
        text += ("Each size ran once: on a shared machine a single run can be off by tens of percent; "
                 "rerun with --repeats 3 to see the spread.")
    return text


def write_markdown(rows: list[dict[str, Any]], path: Path, command: str, paragraph: str,
                   failures: list[tuple[int, int]]) -> None:
    parts = [f"# Scaling: {rows[0]['model']}", "", markdown_table(rows), "", "![throughput and efficiency vs N]"
             f"({path.with_suffix('.png').name})", "", "Produced by:", "", "```bash", command, "```", "", paragraph]
    if failures:
        parts += ["", "Failed runs (left out above): " + ", ".join(f"N={n} (repeat {r + 1})" for n, r in failures)]
    path.write_text("\n".join(parts) + "\n")


def plot(rows: list[dict[str, Any]], summaries: dict[int, list[dict[str, Any]]], path: Path, mode: str) -> None:
    """Left: global tokens/s vs N with the ideal linear line from the smallest N; right: efficiency with 100%."""
    sizes = [r["world_size"] for r in rows]
    base = rows[0]
    fig = Figure(figsize=(10, 4))
    tput, eff = fig.subplots(1, 2)
    ideal = [base["tokens_per_s"] * n / base["world_size"] for n in sizes]
    tput.plot(sizes, ideal, "--", color="gray", label="ideal (linear)")
    tput.plot(sizes, [r["tokens_per_s"] for r in rows], "o-", color="#4C72B0", label="measured (fastest run)")
    runs = [(n, s["tokens_per_s"]) for n, group in summaries.items() for s in group]
    tput.scatter(*zip(*runs, strict=True), s=14, color="#4C72B0", alpha=0.4, label="single runs")
    tput.set(xlabel="world size N", ylabel="global tokens/s", title="throughput", xticks=sizes, ylim=(0, None))
    tput.legend()
    eff.axhline(100, linestyle="--", color="gray", label="ideal (100%)")
    eff.plot(sizes, [100 * r["efficiency"] for r in rows], "o-", color="#C44E52", label="measured")
    for r in rows:
        eff.annotate(f"{r['efficiency']:.0%}", (r["world_size"], 100 * r["efficiency"]), textcoords="offset points",
                     xytext=(0, -14), ha="center")
    eff.set(xlabel="world size N", ylabel=f"efficiency vs N={base['world_size']} (%)", title="scaling efficiency",
            xticks=sizes, ylim=(0, max(110, 100 * max(r["efficiency"] for r in rows) + 10)))
    eff.legend(loc="lower left")
    batches = ", ".join(str(r["global_batch_size"]) for r in rows)
    fig.suptitle(f"{rows[0]['model']}, {mode} scaling (global batch {batches} at N = {', '.join(map(str, sizes))})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def log_wandb(rows: list[dict[str, Any]], png: Path, runs_dir: Path, wandb_cfg: Any, config: dict[str, Any]) -> None:
    """The table and the plot in a W&B run of their own (honours WANDB_MODE); an unreachable W&B only warns."""
    try:
        import wandb

        run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, job_type="scaling", config=config,
                         dir=str(runs_dir), mode=wandb_cfg.mode or os.environ.get("WANDB_MODE"),
                         settings=wandb.Settings(init_timeout=wandb_cfg.init_timeout_s, console="off", silent=True))
        cols = columns(rows)
        run.log({"scaling": wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows]),
                 "scaling_plot": wandb.Image(str(png))})
        run.finish()
    except Exception as exc:  # noqa: BLE001 - the sweep's files are written; W&B is a copy
        print(f"warning: W&B logging failed: {flat(str(exc), 200)}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = compose_config(args.overrides)
        batches = {n: global_batch(args.mode, cfg.data.global_batch_size, n, args.sizes[0]) for n in args.sizes}
    except (ConfigError, ValueError) as exc:
        print(f"scaling: error: {exc}", file=sys.stderr)
        return 2
    runs_dir = args.runs or Path("outputs/scaling") / time.strftime("%Y-%m-%d_%H-%M-%S")
    env, load = child_env(args.sizes), os.getloadavg()[0]
    summaries: dict[int, list[dict[str, Any]]] = {}
    failures: list[tuple[int, int]] = []  # (size, repeat)
    for repeat in range(args.repeats):
        for n in args.sizes:
            run_dir = (runs_dir / str(n) if args.repeats == 1 else runs_dir / f"{n}-{repeat + 1}").absolute()
            try:
                summary = run_one(n, batches[n], run_dir, args.overrides, env)
            except RuntimeError as exc:
                failures.append((n, repeat))
                print(f"scaling: N={n} failed: {exc}", file=sys.stderr, flush=True)
                continue
            summaries.setdefault(n, []).append(summary)
            print(f"N={n}: {summary['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
    if not summaries:
        print("scaling: every run failed; nothing written", file=sys.stderr)
        return 1
    rows = tabulate(summaries)
    out = (args.out or runs_dir).absolute()  # beside the runs, not into whatever directory this was started in
    out.mkdir(parents=True, exist_ok=True)
    md, table, png = out / "scaling.md", out / "scaling.csv", out / "scaling.png"
    write_csv(rows, table)
    plot(rows, summaries, png, args.mode)
    command = shlex.join(["python", "scripts/scaling.py", *argv])
    write_markdown(rows, md, command, reading(rows, args.mode, args.repeats, env, load), failures)
    if args.wandb or cfg.logger.wandb.enabled:
        log_wandb(rows, png, runs_dir, cfg.logger.wandb,
                  {"mode": args.mode, "sizes": args.sizes, "repeats": args.repeats, "overrides": args.overrides})
    print(f"scaling: wrote {md}, {table} and {png}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
