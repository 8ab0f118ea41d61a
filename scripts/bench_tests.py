"""How long tests take here against another checkout of the project, interleaved, and what the launcher imports.

    python scripts/bench_tests.py --base /path/to/other/checkout --repeats 2 -- tests/test_cli.py -k bad_input

Runs the same pytest selection in the other checkout and in this one, alternating, ``--repeats`` times each, and
prints a markdown table of each test's median time (setup + call + teardown) in both, with the ratio. Tests that
exist in one checkout only get a dash on the other side. It also prints the CPU seconds that importing the
launcher costs in each checkout (user + system, so a busy machine changes it less than wall time), and the load
average before and after: on a shared machine compare ratios taken in one run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+)")
LAUNCHER = "import torch.distributed.run, ddptrain.app.launch"


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def test_times(tree: Path, selection: list[str]) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) of one pytest run of ``selection`` in ``tree``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "--durations=0",
           "--durations-min=0", *selection]
    out = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, check=False).stdout
    times: dict[str, float] = defaultdict(float)
    for line in out.splitlines():
        if match := DURATION.match(line.strip()):
            times[match.group(2)] += float(match.group(1))
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line]
    print(f"  {tree}: {summary[-1] if summary else out[-500:]}", file=sys.stderr)
    return dict(times)


def import_cpu_s(tree: Path) -> float:
    """CPU seconds (user + system) of a fresh interpreter importing the launcher from ``tree``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", LAUNCHER], cwd="/", env=_env(tree), check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (e.g. main's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("selection", nargs="+", help="pytest arguments: files, -k, -m")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "this": HERE}
    load_before = _load()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    imports: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            imports[name].append(import_cpu_s(tree))
            runs[name].append(test_times(tree, args.selection))
    print(f"load average before: {load_before}; after: {_load()}; {args.repeats} runs each, interleaved, medians\n")
    print("| test | base s | this s | this / base |\n|---|---:|---:|---:|")
    tests = sorted({t for r in runs.values() for times in r for t in times},
                   key=lambda t: -max(statistics.median([r.get(t, 0.0) for r in runs[n]]) for n in trees))
    totals = {name: 0.0 for name in trees}
    for test in tests:
        med = {}
        for name in trees:
            seen = [r[test] for r in runs[name] if test in r]
            med[name] = statistics.median(seen) if seen else None
            totals[name] += med[name] or 0.0
        ratio = f"{med['this'] / med['base']:.2f}" if med["base"] and med["this"] else "-"
        cells = [f"{med[n]:.1f}" if med[n] is not None else "-" for n in trees]
        print(f"| {test} | {cells[0]} | {cells[1]} | {ratio} |")
    print(f"| **total** | {totals['base']:.1f} | {totals['this']:.1f} | {totals['this'] / totals['base']:.2f} |")
    cpu = {name: statistics.median(imports[name]) for name in trees}
    print(f"\nlauncher import (`{LAUNCHER}`), CPU s: base {cpu['base']:.2f}, this {cpu['this']:.2f}")


if __name__ == "__main__":
    main()
