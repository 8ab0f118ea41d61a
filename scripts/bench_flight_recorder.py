"""What torch's flight recorder costs per training step: ``dist.flight_recorder`` at its default (torch's ring of
2000 entries), shrunk to 64 entries (the earlier default), and off.

Runs the real ``ddptrain`` command with each setting in turn, alternating over repeats (default, 64, off,
default, ...) so machine noise hits all alike, and reports the median of each run's steady step time
(``step_time_s`` in summary.json) and its ratio to off:

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

DEFAULT_RUN = ["model=llama_tiny", "data=synthetic", "launch.nproc_per_node=2", "train.log_every=5",
               "train.eval_every=0", "checkpoint.export=false", "logger.progress=false"]
SETTINGS = {"null": "default (null: torch's ring, 2000 entries)", "64": "64 entries (the earlier default)",
            "0": "off (dist.flight_recorder=0)"}


def run(entries: str, steps: int, extra: list[str], where: Path) -> float:
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
    times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        for repeat in range(args.repeats):
            for setting in SETTINGS:
                times[setting].append(run(setting, args.steps, args.extra, Path(tmp) / f"{setting}-{repeat}"))
    off_s = statistics.median(times["0"])
    print(f"median steady step time of {args.repeats} interleaved runs of {args.steps} steps each "
          f"({' '.join(args.extra) or 'defaults'})")
    print("| dist.flight_recorder | step time (s) | ratio to off | spread (s) |")
    print("|---|---:|---:|---|")
    for setting, label in SETTINGS.items():
        median, spread = statistics.median(times[setting]), f"{min(times[setting]):.4f}-{max(times[setting]):.4f}"
        print(f"| {label} | {median:.4f} | {median / off_s:.3f} | {spread} |")


if __name__ == "__main__":
    main()
