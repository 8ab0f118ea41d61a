"""What torch's flight recorder costs per training step: ``dist.flight_recorder`` on (the default) against off.

Runs the real ``ddptrain`` command with the recorder on and off, alternating over repeats (on, off, on, off, ...)
so machine noise hits both alike, and reports the median of each run's steady step time (``step_time_s`` in
summary.json) and their ratio:

    python scripts/bench_flight_recorder.py --repeats 5 --steps 40 -- model=llama_tiny data=synthetic

Arguments after ``--`` go to every run (the defaults are a small 2-rank DDP run on synthetic data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ddptrain.config.schema import DistConfig

DEFAULT_RUN = ["model=llama_tiny", "data=synthetic", "launch.nproc_per_node=2", "train.log_every=5",
               "train.eval_every=0", "checkpoint.export=false", "logger.progress=false"]


def run(entries: int, steps: int, extra: list[str], where: Path) -> float:
    args = [*DEFAULT_RUN, *extra, f"train.steps={steps}", f"dist.flight_recorder={entries}", f"hydra.run.dir={where}"]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "DDPTRAIN_RUN_DIR")}
    subprocess.run([sys.executable, "-m", "ddptrain", *args], check=True, env=env, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads((where / "summary.json").read_text())["step_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    on = DistConfig().flight_recorder
    times: dict[int, list[float]] = {on: [], 0: []}
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        for repeat in range(args.repeats):
            for entries in (on, 0):
                times[entries].append(run(entries, args.steps, args.extra, Path(tmp) / f"{entries}-{repeat}"))
    on_s, off_s = statistics.median(times[on]), statistics.median(times[0])
    print(f"median steady step time of {args.repeats} interleaved runs of {args.steps} steps each "
          f"({' '.join(args.extra) or 'defaults'})")
    print("| flight recorder | step time (s) | ratio to off |")
    print("|---|---:|---:|")
    print(f"| off (dist.flight_recorder=0) | {off_s:.4f} | 1.000 |")
    print(f"| on (dist.flight_recorder={on}, the default) | {on_s:.4f} | {on_s / off_s:.3f} |")
    print(f"spread: on {min(times[on]):.4f}-{max(times[on]):.4f} s, off {min(times[0]):.4f}-{max(times[0]):.4f} s")


if __name__ == "__main__":
    main()
