"""Wall time of the 4B QLoRA dry run, two checkouts side by side: interleaved runs, the median of each.

    python scripts/bench_dry_run.py --before /path/to/old/checkout --after . --repeats 3 [-- extra overrides]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMAND = ["-m", "ddptrain", "+experiment=qlora_4b", "launch.dry_run=true", "model.pretrained=x"]


def timed(checkout: str, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        start = time.perf_counter()
        subprocess.run([sys.executable, *COMMAND, *extra, f"hydra.run.dir={run_dir}"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name in ("before", "after"):
            times[name].append(timed(getattr(args, name), args.extra))
            print(f"{name}: {times[name][-1]:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"median before {before:.1f} s, after {after:.1f} s: {before / after:.2f}x")


if __name__ == "__main__":
    main()
