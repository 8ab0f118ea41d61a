"""CPU seconds of a dry run's planning (``plan_for_target``: auto, the traces, the options) with ``PeakTracker``
answering fake tensors' ``prim.device`` queries itself and without (each passed through the fake mode's dispatch,
as before), interleaved in one process after a warm-up run, and whether the text and plan.json record are equal.

    PYTHONPATH=. python scripts/bench_device_queries.py --repeats 3 -- +experiment=gpt2_small plan.world_size=8 \
        plan.device=h100

One process: the imports (about 6 CPU s of a command's 13) are paid once and left out; FakeTensor's dispatch cache
is warm for both variants alike after the warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ddptrain.telemetry.storage_peak as storage_peak
from ddptrain.config.compose import compose_config, typed_config
from ddptrain.plan.dry_run import plan_for_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", default=["+experiment=gpt2_small", "plan.world_size=8",
                                                         "plan.device=h100"])
    args = parser.parse_args()
    typed = typed_config(compose_config(["launch.dry_run=true", *args.overrides])).typed
    shortcut_op = storage_peak.DEVICE

    def planned(shortcut: bool) -> tuple[float, tuple[str, dict]]:
        storage_peak.DEVICE = shortcut_op if shortcut else object()  # an object no op is: every query passed on
        start = time.process_time()
        _, text, record = plan_for_target(typed, typed.launch.nproc_per_node)
        return time.process_time() - start, (text, record)

    _, reference = planned(True)
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.repeats):
        for shortcut in (True, False) if i % 2 else (False, True):
            seconds, answer = planned(shortcut)
            assert answer == reference, f"the plan differs {'with' if shortcut else 'without'} the shortcut"
            cpu[shortcut].append(seconds)
    storage_peak.DEVICE = shortcut_op
    for shortcut, label in ((False, "passed on"), (True, "answered by the tracker")):
        runs = ", ".join(f"{c:.2f}" for c in cpu[shortcut])
        print(f"{label}: {runs} CPU s, median {statistics.median(cpu[shortcut]):.2f}, least {min(cpu[shortcut]):.2f}")
    print("text and plan.json record equal in every run")


if __name__ == "__main__":
    main()
