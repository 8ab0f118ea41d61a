"""What one ``run_distributed`` call of the tests costs before any test work: spawned ranks against ranks forked
from the tests' preloaded server, interleaved, median of several calls:

    PYTHONPATH=. python scripts/bench_test_start.py --ranks 2 --repeats 5

Each rank imports the training loop (what almost every multi-process test does) and returns its rank.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import tests.helpers.dist as dist_helper


def trivial_rank(rank: int, world_size: int) -> int:
    import ddptrain.train  # noqa: F401 - the import is the cost being measured

    return rank


def one_call(method: str, ranks: int) -> float:
    dist_helper._CTX = mp.get_context(method)  # the helper's start method, swapped for this call
    start = time.perf_counter()
    assert dist_helper.run_distributed(trivial_rank, ranks) == list(range(ranks))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    one_call("forkserver", args.ranks)  # the server's one-off start (its imports), once per test session
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for _ in range(args.repeats):
        for method in times:
            times[method].append(one_call(method, args.ranks))
    spawn, fork = (statistics.median(times[m]) for m in ("spawn", "forkserver"))
    print(f"{args.ranks} ranks, median of {args.repeats}: spawn {spawn:.2f} s, forkserver {fork:.2f} s, "
          f"ratio {spawn / fork:.0f}x")


if __name__ == "__main__":
    main()
