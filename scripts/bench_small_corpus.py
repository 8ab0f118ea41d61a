"""Preparing a small corpus (a fine-tuning set, a test corpus): CPU and wall seconds, with ``data.num_proc=2``.

Each repeat prepares the same JSON Lines corpus (``--docs`` short code-like documents) into a fresh cache, in a
fresh process per checkout, the checkouts interleaved; CPU seconds are the process's and its children's (a
tokenizer pool's spawned workers). Each checkout runs from its own directory, so ``python -c`` imports its own
``ddptrain``. Prints the medians as a table:

    python scripts/bench_small_corpus.py --trees /path/to/old /path/to/new --docs 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PREPARE = """
import json, resource, sys, time
from ddptrain.config.schema import DataConfig
from ddptrain.data import build_token_data

def cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

if __name__ == "__main__":
    corpus, cache = sys.argv[1], sys.argv[2]
    cfg = DataConfig(source="files", paths=[corpus], cache_dir=cache, vocab_size=300, seq_len=16,
                     val_fraction=0.1, shard_tokens=100000, num_proc=2)
    cpu0, wall0 = cpu(), time.perf_counter()
    build_token_data(cfg)
    print(json.dumps({"cpu_s": cpu() - cpu0, "wall_s": time.perf_counter() - wall0}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=Path, nargs="+", required=True, help="checkouts to compare")
    parser.add_argument("--docs", type=int, default=2000, help="documents in the corpus (2,048 fill one batch)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    docs = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" * (1 + i % 5) for i in range(args.docs)]
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    script = work / "prepare.py"  # a file, not -c: the pool's spawned workers import the main module again
    script.write_text(PREPARE)
    figures: dict[Path, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for repeat in range(args.repeats):
        for k, tree in enumerate(args.trees):
            cache = work / f"cache-{repeat}-{k}"
            out = subprocess.run([sys.executable, "-c", f"import runpy; runpy.run_path({str(script)!r}, "
                                  f"run_name='__main__')", str(corpus), str(cache)], cwd=tree, check=True,
                                 capture_output=True, text=True).stdout
            figures[tree].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.docs} documents, {corpus.stat().st_size / 1e3:.0f} KB; {args.repeats} interleaved repeats, medians\n")
    print("| checkout | CPU s | wall s |\n|---|---:|---:|")
    for tree, runs in figures.items():
        print(f"| {tree} | {statistics.median(r['cpu_s'] for r in runs):.2f} | "
              f"{statistics.median(r['wall_s'] for r in runs):.2f} |")


if __name__ == "__main__":
    main()
