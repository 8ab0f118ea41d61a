"""How long tests take here against another checkout of the project, interleaved, and what the launcher imports;
and the suite's time per file and per tier from one run's figures.

    python scripts/bench_tests.py --base /path/to/other/checkout --repeats 2 -- tests/test_cli.py -k bad_input
    pytest -q -n 2 --dist loadgroup --timing-json=times.json && python scripts/bench_tests.py --report times.json
    python scripts/bench_tests.py --seconds times.json     # the table the longest-first schedule reads
    python scripts/bench_tests.py --seconds some.json --keep   # renew the files some.json measured, keep the rest

Runs the same pytest selection in the other checkout and in this one, alternating, ``--repeats`` times each, and
prints a markdown table of each test's median time (setup + call + teardown) in both, with the ratio. Tests that
exist in one checkout only get a dash on the other side. It also prints the CPU seconds that importing the
launcher costs in each checkout (user + system, so a busy machine changes it less than wall time), and the load
average before and after: on a shared machine compare ratios taken in one run, not seconds across runs.

``--report`` reads the figures ``tests/helpers/timing.py`` wrote (``--timing-json``: each test's wall and CPU
seconds, its tier, the processes and CLI runs it started) and prints them per file and per tier as markdown. CPU
seconds (user + system of each test's process tree) move little with the machine's load; wall seconds do. Then
each xdist worker's timeline: its tests' seconds and when its last test ended, from the run's first test on: the
worker that ends last sets the suite's time, and the tests it ended on are the tail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
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


def report(path: Path) -> None:
    """Per file and tier, then per tier: tests, wall s, CPU s, processes started, CLI runs (markdown)."""
    tests: dict[str, dict] = json.loads(path.read_text())
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    for name, t in tests.items():
        row = rows[(name.split("::")[0], t["tier"])]
        for i, value in enumerate((1, t["wall_s"], t["cpu_s"], t.get("processes", 0), t.get("cli_runs", 0))):
            row[i] += value
    print("| file | tier | tests | wall s | CPU s | processes | CLI runs |\n|---|---|---:|---:|---:|---:|---:|")
    for (file, tier), (n, wall, cpu, procs, cli) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"| {file} | {tier} | {n:.0f} | {wall:.1f} | {cpu:.1f} | {procs:.0f} | {cli:.0f} |")
    for tier in ("fast", "slow"):
        mine = [r for (_, t), r in rows.items() if t == tier]
        if mine:
            n, wall, cpu, procs, cli = (sum(r[i] for r in mine) for i in range(5))
            print(f"| **all** | {tier} | {n:.0f} | {wall:.1f} | {cpu:.1f} | {procs:.0f} | {cli:.0f} |")
    workers(tests)


def workers(tests: dict[str, dict]) -> None:
    """Each pytest-xdist worker's timeline (markdown): its tests, the seconds they took, and when it finished its last
    one, counted from the first test's start; and the tests each worker ended on, the run's tail."""
    timed = [t for t in tests.values() if "start" in t]
    if not timed:
        return
    zero = min(t["start"] for t in timed)
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for t in timed:
        by_worker[t["worker"]].append(t)
    print("\n| worker | tests | wall s of its tests | CPU s | last test ended at s | its last tests |\n"
          "|---|---:|---:|---:|---:|---|")
    for worker, mine in sorted(by_worker.items()):
        mine.sort(key=lambda t: t["end"])
        last = ", ".join(f"{t['test'].split('/')[-1]} ({t['wall_s']:.0f} s)" for t in mine[-3:])
        print(f"| {worker} | {len(mine)} | {sum(t['wall_s'] for t in mine):.1f} | "
              f"{sum(t['cpu_s'] for t in mine):.1f} | {mine[-1]['end'] - zero:.1f} | {last} |")


LONG_TEST_S = 2.0  # tests at least this long are listed by id in the scheduling table; the rest by file mean


def seconds_table(path: Path) -> dict[str, dict[str, float]]:
    """The table ``tests/helpers/schedule.py`` orders work by, from a ``--timing-json`` file: each test of at least
    ``LONG_TEST_S`` wall seconds by id, and each file's mean wall seconds per test in each tier."""
    tests: dict[str, dict] = json.loads(path.read_text())
    per_file: dict[str, list[float]] = defaultdict(list)
    for name, t in tests.items():
        per_file[f"{name.split('::')[0]}::{t['tier']}"].append(t["wall_s"])
    return {"tests": {name: round(t["wall_s"], 1) for name, t in sorted(tests.items())
                      if t["wall_s"] >= LONG_TEST_S},
            "files": {key: round(statistics.mean(walls), 2) for key, walls in sorted(per_file.items())}}


def merged_table(old: dict[str, dict[str, float]], new: dict[str, dict[str, float]],
                 measured: set[str]) -> dict[str, dict[str, float]]:
    """``old`` with ``new``'s figures for the files in ``measured`` (``path::tier`` keys, and the tests of those
    files): a run of some files renews their entries and keeps every other file's."""
    def kept(table: dict[str, float], file_of: Callable[[str], str]) -> dict[str, float]:
        return {k: v for k, v in table.items() if file_of(k) not in measured}

    test_file = lambda name: name.split("::")[0]  # noqa: E731
    tests = {**kept(old["tests"], test_file), **new["tests"]}
    files = {**kept(old["files"], test_file), **new["files"]}
    return {"tests": dict(sorted(tests.items())), "files": dict(sorted(files.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="a --timing-json file: print it per file and tier, run nothing")
    parser.add_argument("--seconds", type=Path, help="a --timing-json file of the whole suite: write the table the "
                        "scheduler orders work by (tests/data/test_seconds.json), run nothing")
    parser.add_argument("--keep", action="store_true", help="with --seconds: renew only the files that run measured, "
                        "keep the table's other entries")
    parser.add_argument("--base", type=Path, help="the other checkout (e.g. main's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("selection", nargs="*", help="pytest arguments: files, -k, -m")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if args.seconds:
        table = HERE / "tests" / "data" / "test_seconds.json"
        figures = seconds_table(args.seconds)
        if args.keep and table.is_file():
            measured = {name.split("::")[0] for name in json.loads(args.seconds.read_text())}
            figures = merged_table(json.loads(table.read_text()), figures, measured)
        table.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {table}")
        return
    if args.base is None or not args.selection:
        parser.error("--base and a selection are needed to compare two checkouts")
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
