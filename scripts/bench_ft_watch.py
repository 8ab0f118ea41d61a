"""The local launcher's poll of the groups' event files (``ddptrain/ft/supervise.py``), old and new, side by side:
``python scripts/bench_ft_watch.py [--old PATH] --steps 1000 10000 100000``.

For each length, 3 groups' event files of that many committed steps each; then 20 polls, each after one more
step per group is appended (what a poll meets in a run): the CPU of one poll, whole files re-read (``quorum_lost``,
or the old module at ``--old``) against the watch that reads on from the last poll (``GroupEvents``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ddptrain.ft import supervise
from ddptrain.ft.layout import events_path

GROUPS, POLLS = 3, 20


def step(s: int) -> str:
    return json.dumps({"event": "step", "step": s, "quorum": GROUPS, "committed": True}) + "\n"


def per_poll(run_dir: Path, steps: int, poll: Callable[[], str | None]) -> float:
    spent = 0.0
    for s in range(steps + 1, steps + 1 + POLLS):
        for g in range(GROUPS):
            with events_path(run_dir, g).open("a") as out:
                out.write(step(s))
        started = time.process_time()
        assert poll() is None
        spent += time.process_time() - started
    return spent / POLLS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--old", help="an older supervise.py to time its quorum_lost (default: this one's)")
    args = parser.parse_args()
    whole = supervise.quorum_lost
    if args.old:
        spec = importlib.util.spec_from_file_location("old_supervise", args.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        whole = old.quorum_lost
    print("| steps per group | whole files per poll (ms CPU) | read on per poll (ms CPU) |\n|---:|---:|---:|")
    for steps in args.steps:
        results = []
        for mode in ("whole", "read on"):
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp)
                for g in range(GROUPS):
                    path = events_path(run_dir, g)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("".join(step(s) for s in range(1, steps + 1)))
                if mode == "whole":
                    results.append(per_poll(run_dir, steps, lambda d=run_dir: whole(d, GROUPS)))
                else:
                    watch = supervise.GroupEvents(run_dir, GROUPS)
                    watch.lost()  # the launcher's first poll: the files so far
                    results.append(per_poll(run_dir, steps, watch.lost))
        print(f"| {steps:,} | {results[0] * 1e3:.1f} | {results[1] * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
