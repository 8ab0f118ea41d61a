"""What starting a run's workers costs, and what forking them from a preloaded server would save.

A CLI run's CPU is mostly start-up: every worker process imports torch, transformers' model classes and the trainer
before its first step (about 6 CPU s each here), and the launcher imports torch once more for torchrun's agent.
This benchmark times one short run two ways, interleaved, with the same arguments:

- ``torchrun``: ``torchrun --standalone --nproc-per-node=N -m ddptrain ARGS``, each worker a fresh interpreter
  (torchrun's own way for a module entry point, and what ``ddptrain`` does through ``torch.distributed.run``);
- ``forkserver``: the same agent through ``torch.distributed.launcher.api.elastic_launch`` with a function entry
  point and ``start_method="forkserver"``, the server preloading torch, transformers' Llama and the trainer once,
  each worker a fork of it (the design option measured; ddptrain does not launch this way).

CPU seconds are the whole process tree's (this script is a child subreaper and reaps every descendant, the fork
server and its workers included); both runs must exit 0 and print the same last loss line. Prints the medians:

    python scripts/bench_worker_start.py --repeats 3 --nproc 2
    python scripts/bench_worker_start.py --repeats 3 --nproc 2 -- +experiment=quickstart train.steps=2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
PRELOAD = ["torch", "transformers.models.llama.modeling_llama", "ddptrain.train.trainer", "ddptrain.app.cli"]
DEFAULT_ARGS = ["+experiment=quickstart", "train.steps=2", "checkpoint.export=false", "logger.progress=false"]

# The forkserver variant, written to a file and run as ``python FILE NPROC ARGS...`` (the fork server's children
# import the entry point from the main module's file: ``python -c`` has none).
FORKSERVER = f"""
import multiprocessing, sys, uuid

def entry(*argv):
    sys.argv = ["ddptrain", *argv]
    from ddptrain.app.cli import main
    main()

if __name__ == "__main__":
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser
    multiprocessing.set_forkserver_preload({PRELOAD!r})
    nproc, argv = sys.argv[1], sys.argv[2:]
    args = get_args_parser().parse_args([f"--nproc-per-node={{nproc}}", "-m", "ddptrain", *argv])
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # --standalone
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    elastic_launch(config, entrypoint=entry)(*argv)
"""

LOSS_LINE = re.compile(r"step (\d+)/\d+ \| loss ([0-9.]+)")


def tree_cpu_seconds() -> float:
    """User + system seconds of every descendant reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap_all() -> None:
    """Wait for every descendant this subreaper inherited (a fork server outlives its launcher by a moment)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def timed(command: list[str], cwd: Path) -> tuple[float, float, str]:
    """(CPU s of the whole tree, wall s, the last loss line) of one run; raises if it fails."""
    cpu0, wall0 = tree_cpu_seconds(), time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    reap_all()
    cpu, wall = tree_cpu_seconds() - cpu0, time.perf_counter() - wall0
    losses = LOSS_LINE.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not losses:
        raise SystemExit(f"{command[:4]}... exited {done.returncode}:\n{done.stderr[-2000:]}")
    return cpu, wall, " ".join(losses[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("args", nargs="*", default=DEFAULT_ARGS, help="ddptrain overrides (after --)")
    opts = parser.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    figures: dict[str, list[tuple[float, float]]] = {"torchrun": [], "forkserver": []}
    last: dict[str, str] = {}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        launcher = Path(tmp) / "forkserver_launch.py"
        launcher.write_text(FORKSERVER)
        for repeat in range(opts.repeats):
            for name in figures:
                run_dir = f"hydra.run.dir={tmp}/{name}-{repeat}"
                command = ([torchrun, "--standalone", f"--nproc-per-node={opts.nproc}", "-m", "ddptrain",
                            *opts.args, run_dir] if name == "torchrun" else
                           [sys.executable, str(launcher), str(opts.nproc), *opts.args, run_dir])
                cpu, wall, last[name] = timed(command, Path(tmp))
                figures[name].append((cpu, wall))
    if last["torchrun"] != last["forkserver"]:
        raise SystemExit(f"the two ways trained differently: {last}")
    print(f"load average after: {os.getloadavg()[0]:.2f}; both ended at step/loss {last['torchrun']}")
    print(f"{'workers started by':<20} {'CPU s (median)':>15} {'wall s (median)':>16}")
    for name, runs in figures.items():
        cpu, wall = statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs)
        print(f"{name:<20} {cpu:>15.1f} {wall:>16.1f}")


if __name__ == "__main__":
    main()
