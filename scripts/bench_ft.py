"""Replica groups (torchft) against restart-the-world under the same injected failures, and DiLoCo's bytes and loss
against DDP: the figures of docs/benchmarks.md ("Beyond restart-the-world").

    python scripts/bench_ft.py goodput --steps 60 --kill-every 15 --repeats 2
    python scripts/bench_ft.py diloco --steps 64 --sync-every 1 8 32
    python scripts/bench_ft.py model --gpus 1024 --gpus-per-group 8 --failures-per-hour 1 --restart-s 600 ...

``goodput``: the same training (llama_tiny on the quickstart data, 3 ranks, global batch 12) run two ways, the
pairs interleaved: **replica groups** (``ft.replica_groups=3``, one worker each, ``ft.min_replicas=1``) and
**restart-the-world** (``launch.nproc_per_node=3 launch.max_restarts=N``, a checkpoint every ``--checkpoint-every``
steps). A watcher kills one worker process with SIGKILL from outside every ``--kill-every`` steps of progress (the
groups' ranks in turn; under restart-the-world ranks 1, 2, 0, ...), as a machine's failure would, so both policies
meet the same failures at the same steps. Reported per run: wall-clock to the last step, goodput (summary.json),
the kills, and for replica groups each heal's seconds (ft.json); the medians per policy and their ratio.

``diloco``: 2 replica groups of one worker under ``ft.sync=diloco`` for each H in ``--sync-every`` and under
``ft.sync=ddp``: summary.json's ``comm_bytes`` (payload per step and rank) and the final loss.

``model``: the goodput-under-failures model (``ddptrain/plan/whatif/failures.py``) at a scale given by its flags
(measured costs from ``goodput``, or assumed ones, stated as such where they are quoted).

Every run happens in a temporary directory and is deleted after its figures are read (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

BASE = ["model=llama_tiny", "data.seq_len=128", "data.global_batch_size=12", "data.micro_batch_size=4",
        "optim.lr=2e-3", "optim.warmup_steps=10", "train.log_every=1", "train.eval_every=0",
        "checkpoint.export=false", "logger.progress=false", "hydra.run.dir=run"]
DDPTRAIN = [sys.executable, "-m", "ddptrain"]


@contextmanager
def run_dir_for(prefix: str, keep: bool) -> Iterator[str]:
    """A temporary working directory for one run, removed after unless ``keep`` (Python 3.11 has no ``delete``)."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        if keep:
            print(f"kept {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def workers(root: psutil.Process) -> list[psutil.Process]:
    """The training workers under ``root``: processes whose environment has torchrun's LOCAL_RANK."""
    found = []
    for child in root.children(recursive=True):
        try:
            if "LOCAL_RANK" in child.environ() and "ddptrain" in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def progress(run_dir: Path) -> int:
    """The last step any group (or the run) logged: the max over every metrics.jsonl under the run dir."""
    last = 0
    for path in run_dir.rglob("metrics.jsonl"):
        for line in path.read_text().splitlines()[-3:]:
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except ValueError:
                continue
    return last


def run_with_kills(args: list[str], cwd: Path, kill_every: int, steps: int, replica_groups: bool) -> dict:
    """Run ``ddptrain <args>``; kill one worker each ``kill_every`` steps of progress (the groups' or the ranks'
    in turn). Returns the wall-clock, the kills (step, whom) and the exit code."""
    env = {**os.environ, "RUST_LOG": "warn"}
    started = time.perf_counter()
    proc = subprocess.Popen([*DDPTRAIN, *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    root, kills, target = psutil.Process(proc.pid), [], 1
    next_kill = kill_every
    while proc.poll() is None:
        time.sleep(0.2)
        done = progress(cwd / "run")
        if next_kill < steps and done >= next_kill:
            victims = []
            for w in workers(root):
                env_w = w.environ()
                rank = int(env_w.get("RANK", "-1"))
                group = next((int(a.split("=")[1]) for a in w.cmdline() if a.startswith("ft.replica_id=")), None)
                if (group if replica_groups else rank) == target:
                    victims.append(w)
            if victims:
                victims[0].send_signal(signal.SIGKILL)
                kills.append({"step": done, "target": target, "at_s": round(time.perf_counter() - started, 2)})
                target = (target + 1) % 3
                next_kill += kill_every
    stderr = proc.stderr.read() if proc.stderr else ""
    return {"wall_s": time.perf_counter() - started, "returncode": proc.returncode, "kills": kills,
            "stderr_tail": stderr[-600:]}


def goodput(kill_every: int, steps: int, checkpoint_every: int, repeats: int, keep: bool) -> None:
    policies = {
        "replica groups": [*BASE, f"train.steps={steps}", "ft.replica_groups=3", "ft.min_replicas=1",
                           "launch.nproc_per_node=1", f"ft.group_restarts={steps // kill_every + 1}",
                           f"checkpoint.every_n_steps={checkpoint_every}"],
        "restart-the-world": [*BASE, f"train.steps={steps}", "launch.nproc_per_node=3",
                              f"launch.max_restarts={steps // kill_every + 1}",
                              f"checkpoint.every_n_steps={checkpoint_every}"],
    }
    results: dict[str, list[dict]] = {name: [] for name in policies}
    for repeat in range(repeats):
        for name, args in policies.items():  # interleaved: the machine's load falls on both alike
            with run_dir_for("bench_ft_", keep) as tmp:
                cwd = Path(tmp)
                ran = run_with_kills(args, cwd, kill_every, steps, name == "replica groups")
                summary_path = cwd / "run" / "summary.json"
                summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
                ft_path = cwd / "run" / "ft.json"
                ft = json.loads(ft_path.read_text()) if ft_path.is_file() else {}
                ran["goodput_pct"] = summary.get("goodput_pct")
                ran["heals_s"] = [h["seconds"] for g in ft.get("replica_groups", []) for h in g["heals"]]
                ran["attempts"] = [g["attempts"] for g in ft.get("replica_groups", [])]
                ran["final_loss"] = summary.get("final_loss")
                results[name].append(ran)
                print(f"repeat {repeat + 1} {name}: {json.dumps({k: v for k, v in ran.items() if k != 'stderr_tail'})}",
                      flush=True)
                if ran["returncode"] != 0:
                    print(ran["stderr_tail"], file=sys.stderr)
    print(f"\n| policy | wall-clock to step {steps} (median) | goodput (median) | kills | heals (s) |")
    print("|---|---:|---:|---:|---|")
    for name, runs in results.items():
        ok = [r for r in runs if r["returncode"] == 0]
        if not ok:
            print(f"| {name} | failed | | | |")
            continue
        wall = statistics.median(r["wall_s"] for r in ok)
        good = statistics.median(r["goodput_pct"] or 0.0 for r in ok)
        heals = sorted(s for r in ok for s in r["heals_s"])
        print(f"| {name} | {wall:.1f} s | {good:.1f} % | {statistics.median(len(r['kills']) for r in ok):.0f} | "
              f"{', '.join(f'{s:.2f}' for s in heals) or '-'} |")
    walls = {n: [r["wall_s"] for r in runs if r["returncode"] == 0] for n, runs in results.items()}
    if all(walls.values()):
        ratios = [w / g for w, g in zip(walls["restart-the-world"], walls["replica groups"], strict=False)]
        print(f"\nwall-clock ratio restart-the-world / replica groups, per interleaved pair: "
              f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")


def diloco(steps: int, sync_every: list[int], keep: bool) -> None:
    configs = {"ddp": ["ft.sync=ddp"], **{f"diloco H={h}": ["ft.sync=diloco", f"ft.sync_every={h}"]
                                          for h in sync_every}}
    print("| sync | comm_bytes per step and rank | vs DDP | final loss |\n|---|---:|---:|---:|")
    ddp_bytes = None
    for name, extra in configs.items():
        args = [*BASE, "data.global_batch_size=8", f"train.steps={steps}", "ft.replica_groups=2",
                "ft.min_replicas=2", "launch.nproc_per_node=1", *extra]
        with run_dir_for("bench_diloco_", keep) as tmp:
            done = subprocess.run([*DDPTRAIN, *args], cwd=tmp, capture_output=True, text=True,
                                  env={**os.environ, "RUST_LOG": "warn"})
            if done.returncode != 0:
                print(f"| {name} | failed ({done.returncode}) | | |", flush=True)
                print(done.stderr[-1500:], file=sys.stderr)
                continue
            summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        sent = summary["comm_bytes"]
        ddp_bytes = ddp_bytes or sent
        print(f"| {name} | {sent:,.0f} | {sent / ddp_bytes:.3f} | {summary['final_loss']:.4f} |", flush=True)


def model(args: argparse.Namespace) -> None:
    from ddptrain.plan.whatif.failures import FailureCosts, replica_groups, restart_the_world

    costs = FailureCosts(step_s=args.step_s, checkpoint_every_s=args.checkpoint_every_s, save_s=args.save_s,
                         restart_s=args.restart_s, detect_s=args.detect_s, group_restart_s=args.group_restart_s,
                         heal_s=args.heal_s, step_overhead=args.step_overhead)
    groups = args.gpus // args.gpus_per_group
    print(f"{args.gpus} GPUs, {groups} replica groups of {args.gpus_per_group}; {costs}")
    print("| failures / hour | restart-the-world | replica groups | where restart-the-world's time went |")
    print("|---:|---:|---:|---|")
    for rate in args.failures_per_hour:
        world, ft = restart_the_world(costs, rate), replica_groups(costs, rate, groups)
        lost = ", ".join(f"{k} {v:.1%}" for k, v in world.lost.items())
        print(f"| {rate:g} | {world.goodput:.1%} | {ft.goodput:.1%} | {lost} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    g = sub.add_parser("goodput")
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--kill-every", type=int, default=15)
    g.add_argument("--checkpoint-every", type=int, default=10)
    g.add_argument("--repeats", type=int, default=2)
    d = sub.add_parser("diloco")
    d.add_argument("--steps", type=int, default=64)
    d.add_argument("--sync-every", type=int, nargs="+", default=[1, 8, 32])
    for p in (g, d):
        p.add_argument("--keep", action="store_true", help="keep the run directories")
    m = sub.add_parser("model")
    m.add_argument("--gpus", type=int, default=1024)
    m.add_argument("--gpus-per-group", type=int, default=8)
    m.add_argument("--failures-per-hour", type=float, nargs="+", default=[0.5, 1, 2, 4])
    for name, default in (("step-s", 1.0), ("checkpoint-every-s", 1800.0), ("save-s", 10.0), ("restart-s", 600.0),
                          ("detect-s", 10.0), ("group-restart-s", 120.0), ("heal-s", 30.0), ("step-overhead", 0.0)):
        m.add_argument(f"--{name}", type=float, default=default)
    args = parser.parse_args()
    if args.what == "goodput":
        goodput(args.kill_every, args.steps, args.checkpoint_every, args.repeats, args.keep)
    elif args.what == "model":
        model(args)
    else:
        diloco(args.steps, args.sync_every, args.keep)


if __name__ == "__main__":
    main()
