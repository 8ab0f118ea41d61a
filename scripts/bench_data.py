"""Data preparation at scale: throughput and peak memory against corpus size, next to the tokenizer's limit.

Writes JSON Lines corpora of a few sizes from the Python standard library's own sources (each copy of a file
varied by a header line, so no two documents are equal), then, for each size, in a fresh process:

- prepares it with a fixed 8k byte-level BPE (``data.tokenizer``, trained once here on the stdlib) and with the
  default path (``data.tokenizer`` unset: the BPE trains on ``data.tokenizer_sample_mb`` of the corpus first);
- reads 2,000 random ``seq_len`` windows from the warm cache (the training-time view).

Peak memory is the summed RSS of the process and all its children (the tokenizer workers), sampled every 50 ms.
The training read reports its RSS in two parts: anonymous memory (heap: what the process itself holds, the part
that must not grow with the corpus) and the shards' pages its memory maps have touched (clean file-backed pages,
read from ``/proc/self/smaps``: they grow with how much of the shards the reads visit, and the kernel drops them
under memory pressure and reads them again when used).
The tokenizer limit is the same BPE's ``encode_batch`` on every core (``RAYON_NUM_THREADS`` = cores) over the
largest corpus's text, read beforehand, in another fresh process. Example (the table is ready to paste):

    python scripts/bench_data.py --sizes 64 512 --repeats 2
    python scripts/bench_data.py --sizes 2 16 --repeats 1        # a quick check of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

PREPARE = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from ddptrain.config.schema import DataConfig
    from ddptrain.data import build_token_data
    kw = json.loads(sys.argv[1])
    start = time.perf_counter()
    data = build_token_data(DataConfig(**kw))
    seconds = time.perf_counter() - start
    done = next(Path(kw["cache_dir"]).glob("tokens-*/DONE.json"))
    tokens = sum(v for k, v in json.loads(done.read_text()).items() if k.endswith("_tokens"))
    print(json.dumps({"seconds": seconds, "tokens": tokens}))
""")

READ = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from ddptrain.config.schema import DataConfig
    from ddptrain.data import build_token_data
    data = build_token_data(DataConfig(**json.loads(sys.argv[1])))
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    total = sum(int(data.train[int(i)]["input_ids"][0]) for i in rng.integers(0, len(data.train), 2000))
    seconds = time.perf_counter() - start
    # what the reads left resident, by kind: anonymous (heap) memory, and the file pages of the shards' memory
    # maps (clean, file-backed: the kernel drops them under memory pressure and reads them again when used)
    rollup = {line.split(":")[0]: int(line.split()[1]) * 1024
              for line in open("/proc/self/smaps_rollup").read().splitlines()[1:]}
    shard_pages, mapping = 0, ""
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping's first line: address range ... path
            mapping = fields[-1] if len(fields) >= 6 else ""
        elif fields[0] == "Rss:" and "/tokens-" in mapping and mapping.endswith(".bin"):
            shard_pages += int(fields[1]) * 1024
    print(json.dumps({"seconds": seconds, "windows": len(data.train), "check": total,
                      "rss": rollup["Rss"], "anonymous": rollup["Anonymous"], "shard_pages": shard_pages}))
""")

LIMIT = textwrap.dedent("""
    import json, sys, time
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1])
    texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i : i + 1024], add_special_tokens=False))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens, "bytes": sum(len(t.encode()) for t in texts)}))
""")


def write_corpus(path: Path, megabytes: float) -> int:
    """Standard-library sources repeated until ``megabytes``; each copy starts with its own comment line."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    written, copy = 0, 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            for name, text in zip(files, texts, strict=True):
                doc = f"# copy {copy} of {name.name}\n{text}"
                f.write(json.dumps({"text": doc}) + "\n")
                written += len(doc.encode())
                if written >= megabytes * 1e6:
                    break
            copy += 1
    return written


def run_measured(code: str, args: list[str], env: dict[str, str]) -> tuple[dict, float, float]:
    """Run ``python -c code args`` and return its JSON result, the peak RSS (GB) of its process tree and the peak
    of its anonymous part (GB): RSS less the resident file-backed and shared pages (``statm``'s third field)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    root, peak, peak_anonymous = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        try:
            memory = [p.memory_info() for p in (root, *root.children(recursive=True)) if p.is_running()]
            peak = max(peak, sum(m.rss for m in memory))
            peak_anonymous = max(peak_anonymous, sum(m.rss - m.shared for m in memory))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a measured run failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak / 1e9, peak_anonymous / 1e9


def train_fixed_bpe(directory: Path) -> Path:
    from ddptrain.data.corpus import stdlib_files
    from ddptrain.data.tokenizer import train_bpe

    tok = train_bpe((p.read_text(errors="replace") for p in stdlib_files()), 8192)
    tok.save_pretrained(str(directory))
    return directory


def check_cost(directory: Path, repeats: int = 5) -> tuple[float, float]:
    """Microseconds per window of one pass of random 1024-token reads over a fresh map of a 64 MiB shard: with
    each checksum block checked on its first read, and with every block marked checked beforehand (medians of
    interleaved runs). The difference is what the checks add to a first epoch."""
    import numpy as np

    from ddptrain.data.shards import ShardWriter, TokenWindows, finished_shards

    rng = np.random.default_rng(0)
    writer = ShardWriter(directory, "train", np.dtype(np.uint16), 0, 1 << 40)
    for i in range(64):
        writer.add(rng.integers(0, 8192, 1 << 19), 1, i, i + 1)
    writer.finish()
    shards = finished_shards(directory, "train")
    timings: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for checked in (True, False):
            windows = TokenWindows(shards, 1024)
            windows.opened(0)[2][:] = not checked
            order = rng.permutation(len(windows))
            start = time.perf_counter()
            for i in order:
                windows[int(i)]
            timings[checked].append((time.perf_counter() - start) / len(windows) * 1e6)
    return statistics.median(timings[True]), statistics.median(timings[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[64, 512], help="corpus sizes in MB")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per size and path (median)")
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: every core)")
    parser.add_argument("--sample-mb", type=float, default=16.0, help="data.tokenizer_sample_mb for the default path")
    parser.add_argument("--dir", type=Path, default=None, help="where corpora and caches go (default: a temp dir)")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tokenizer = train_fixed_bpe(work / "bpe8k")
    corpora = {size: work / f"corpus-{size:g}mb.jsonl" for size in args.sizes}
    text_bytes = {size: write_corpus(path, size) for size, path in corpora.items()}

    limit_env = {**env, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(cores)}
    largest = max(args.sizes)
    limit, _, _ = run_measured(LIMIT, [str(tokenizer / "tokenizer.json"), str(corpora[largest])], limit_env)
    limit_mbs = limit["bytes"] / limit["seconds"] / 1e6

    (work / "check-cost").mkdir(exist_ok=True)
    checked_us, unchecked_us = check_cost(work / "check-cost")

    rows = []
    for size, corpus in corpora.items():
        for path, extra in (("fixed 8k BPE", {"tokenizer": str(tokenizer)}),
                            ("BPE trained here", {"vocab_size": 8192, "tokenizer_sample_mb": args.sample_mb})):
            runs, peaks, reads, read_peaks, read_anonymous = [], [], [], [], []
            for _ in range(args.repeats):  # sizes x paths x repeats, each in a fresh process on a cold cache
                cache = work / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                kw = {"source": "files", "paths": [str(corpus)], "cache_dir": str(cache), "num_proc": args.num_proc,
                      "seq_len": 1024, **extra}
                result, peak, _ = run_measured(PREPARE, [json.dumps(kw)], env)
                runs.append(result)
                peaks.append(peak)
                read, read_peak, anonymous = run_measured(READ, [json.dumps(kw)], env)
                reads.append(read)
                read_peaks.append(read_peak)
                read_anonymous.append(anonymous)
            seconds = statistics.median(r["seconds"] for r in runs)
            rows.append({"size": size, "path": path, "mbs": text_bytes[size] / seconds / 1e6,
                         "tokens_s": runs[0]["tokens"] / seconds, "peak": statistics.median(peaks),
                         "read_peak": statistics.median(read_peaks), "seconds": seconds,
                         "read_anonymous": statistics.median(read_anonymous),
                         "shard_pages": statistics.median(r["shard_pages"] for r in reads) / 1e9,
                         "shards": sum(f.stat().st_size for f in cache.glob("tokens-*/*.bin")) / 1e9})
    print(f"\ncores: {cores} | load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} | "
          f"num_proc: {args.num_proc or cores} | repeats: {args.repeats} (medians)\n")
    print(f"tokenizer limit (encode_batch on {cores} cores, {largest:g} MB corpus): {limit_mbs:.2f} MB/s, "
          f"{limit['tokens'] / limit['seconds'] / 1e6:.2f} M tokens/s\n")
    print("| corpus | path | prepare s | MB/s | M tokens/s | x limit | peak RSS prepare (GB) | training read: "
          "peak anonymous (GB) | shard pages mapped (GB) | peak RSS (GB) | shards on disk (GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']:g} MB | {r['path']} | {r['seconds']:.1f} | {r['mbs']:.2f} | {r['tokens_s'] / 1e6:.2f} | "
              f"{r['mbs'] / limit_mbs:.2f} | {r['peak']:.2f} | {r['read_anonymous']:.3f} | {r['shard_pages']:.3f} | "
              f"{r['read_peak']:.3f} | {r['shards']:.3f} |")
    smallest = min(args.sizes)
    print()
    for path in ("fixed 8k BPE", "BPE trained here"):
        small = next(r for r in rows if r["size"] == smallest and r["path"] == path)
        big = next(r for r in rows if r["size"] == largest and r["path"] == path)
        print(f"{path}: {largest / smallest:g}x the corpus -> prepare peak RSS x{big['peak'] / small['peak']:.2f}, "
              f"training-read peak anonymous memory x{big['read_anonymous'] / small['read_anonymous']:.2f} (whole "
              f"RSS x{big['read_peak'] / small['read_peak']:.2f}, shard pages mapped {small['shard_pages']:.3f} -> "
              f"{big['shard_pages']:.3f} GB); throughput at {largest:g} MB = {big['mbs'] / limit_mbs:.2f}x the "
              "tokenizer limit")
    print(f"\nshard checksums: a first pass of random 1024-token windows over a fresh 64 MiB shard takes "
          f"{checked_us:.1f} us per window with each block checked on first read, {unchecked_us:.1f} us with the "
          "checks already done")
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
