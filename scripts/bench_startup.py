"""How long ``ddptrain`` takes to answer before it trains (``--help``, ``--cfg``, a config error), what a worker
imports before its first step, and a whole one-step run, beside an empty interpreter and ``import torch``,
interleaved in one run.

    python scripts/bench_startup.py --repeats 7
    python scripts/bench_startup.py --repeats 7 --base /path/to/other/checkout   # this tree against another

Each repeat runs every command once, in turn (so load from other processes falls on all of them alike); the table
gives each command's median wall-clock seconds, its median CPU seconds (user + system: much less sensitive to
load), and its wall time as a multiple of ``python -c pass`` and of ``import torch``. The commands run the package
from this tree (and from ``--base``: the same command with that tree first on ``PYTHONPATH``), from a temporary
directory, offline. The load average before and after is printed: quote it with the figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ENTRY = "import sys; from ddptrain.app.cli import main; sys.argv[0] = 'ddptrain'; main()"  # the console script
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    'python -c "import torch"': ["-c", "import torch"],
    "ddptrain --help": ["-c", ENTRY, "--help"],
    "ddptrain --cfg job +experiment=quickstart": ["-c", ENTRY, "--cfg", "job", "+experiment=quickstart"],
    "ddptrain launch.nproc_per_node=0 (schema error)": ["-c", ENTRY, "launch.nproc_per_node=0"],
    "ddptrain data.global_batch_size=3 (batch error)": ["-c", ENTRY, "data.global_batch_size=3",
                                                        "data.micro_batch_size=2"],
    # what every worker of a run imports before its first step (its command line, process group, trainer)
    "a worker's modules": ["-c", "import ddptrain.app.cli, ddptrain.runtime.process_group, ddptrain.train.trainer"],
    # a whole one-process run on the embedded corpus (its tokenizer cached after the first repeat): one step, a
    # checkpoint and the export
    "ddptrain model.num_layers=1 train.steps=1 (one process)": [
        "-c", ENTRY, "model.num_layers=1", "train.steps=1", "train.eval_every=0", "logger.progress=false",
        "hydra.run.dir=runs/${now:%H-%M-%S-%f}"],
}
NEEDS_PACKAGE = {name for name, argv in COMMANDS.items() if any("ddptrain" in a for a in argv)}


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int]:
    """Wall and CPU seconds (user + system) of one run of ``python <argv>``, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    code = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, check=False).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), code


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--base", type=Path, help="another checkout of ddptrain to compare with")
    args = parser.parse_args()
    trees = {"this": HERE, **({"base": args.base.resolve()} if args.base else {})}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cases = [(name, tree) for name in COMMANDS for tree in (trees if name in NEEDS_PACKAGE else ["this"])]
    seen: dict[tuple[str, str], list[tuple[float, float, int]]] = {case: [] for case in cases}
    load_before = _load()
    with tempfile.TemporaryDirectory() as cwd:
        env["DDPTRAIN_CACHE_DIR"] = cwd
        for _ in range(args.repeats):
            for name, tree in cases:
                seen[(name, tree)].append(timed(COMMANDS[name], {**env, "PYTHONPATH": str(trees[tree])}, cwd))
    wall = {case: statistics.median(w for w, _, _ in runs) for case, runs in seen.items()}
    cpu = {case: statistics.median(c for _, c, _ in runs) for case, runs in seen.items()}
    empty, torch_ = wall[("python -c pass", "this")], wall[('python -c "import torch"', "this")]
    print(f"load average before: {load_before}; after: {_load()}; {args.repeats} interleaved repeats, medians; "
          f"python {sys.version.split()[0]}\n")
    # the exit codes every repeat gave: a config error's 2 is its answer; a run that failed is no figure
    print("| command | tree | wall s | CPU s | wall / `python -c pass` | wall / `import torch` | exit |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, tree in cases:
        case = (name, tree)
        print(f"| `{name}` | {tree} | {wall[case]:.2f} | {cpu[case]:.2f} | {wall[case] / empty:.1f} | "
              f"{wall[case] / torch_:.2f} | {','.join(str(c) for c in sorted({c for _, _, c in seen[case]}))} |")


if __name__ == "__main__":
    main()
