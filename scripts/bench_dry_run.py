"""Wall and CPU time of a dry run (by default the 4B QLoRA one), two checkouts side by side: interleaved runs,
the median of each. CPU seconds (the command's process, user and system) move far less with other processes'
load than wall seconds on a shared machine.

    python scripts/bench_dry_run.py --before /path/to/old/checkout --after . --repeats 3 [-- extra overrides]
    python scripts/bench_dry_run.py --before OLD --after . --command "+experiment=gpt2_small plan.world_size=8 \
        data.micro_batch_size=auto plan.device=h100"
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

QLORA = "+experiment=qlora_4b model.pretrained=x"


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(checkout: str, overrides: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one dry run of ``checkout``."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        start, cpu = time.perf_counter(), children_cpu()
        # run from the checkout: ``-m`` puts the working directory first on sys.path, so run from another
        # checkout it would import that one's ddptrain whatever PYTHONPATH says
        subprocess.run([sys.executable, "-m", "ddptrain", "launch.dry_run=true", *overrides,
                        f"hydra.run.dir={run_dir}"], env=env, check=True, cwd=checkout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start, children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--command", default=QLORA, help="the dry run's overrides (default: the 4B QLoRA run's)")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    overrides = [*shlex.split(args.command), *args.extra]
    times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name in ("before", "after"):
            times[name].append(timed(getattr(args, name), overrides))
            wall, cpu = times[name][-1]
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} CPU s (load {os.getloadavg()[0]:.1f})", flush=True)
    for i, unit in enumerate(("s wall", "CPU s")):
        before, after = (statistics.median(t[i] for t in times[n]) for n in ("before", "after"))
        print(f"median before {before:.1f} {unit}, after {after:.1f} {unit}: {before / after:.2f}x")


if __name__ == "__main__":
    main()
