"""Torch threads for one worker: the quickstart's training step at 1, 2, ... threads, interleaved, in one process.

    python scripts/bench_threads.py --threads 1 2 --repeats 7 --steps 4

Builds the quickstart's model (llama_tiny) and trains it on random tokens at its micro batch (8 x 128), forward +
backward + AdamW, fp32. Each repeat runs ``--steps`` steps at each thread count in turn (``torch.set_num_threads``;
the order alternates from repeat to repeat), after one warm-up step per count; prints each count's median
tokens/s over the repeats, their spread, and the load average before and after. What runtime.topology's
``threads_per_worker`` chooses is measured this way (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ddptrain.config.schema import ModelConfig
from ddptrain.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(ModelConfig(), 8192)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (args.batch, args.seq_len))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    load_before = os.getloadavg()
    for n in args.threads:  # warm-up: allocator, kernels' first calls
        torch.set_num_threads(n)
        step()
    rates: dict[int, list[float]] = {n: [] for n in args.threads}
    for repeat in range(args.repeats):
        order = args.threads if repeat % 2 == 0 else args.threads[::-1]
        for n in order:
            torch.set_num_threads(n)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            rates[n].append(args.steps * args.batch * args.seq_len / (time.perf_counter() - start))
    load_after = os.getloadavg()
    print(f"cores {os.cpu_count()}; load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{args.repeats} repeats x {args.steps} steps of {args.batch}x{args.seq_len} tokens")
    base = statistics.median(rates[args.threads[0]])
    for n in args.threads:
        median = statistics.median(rates[n])
        print(f"threads {n}: median {median:,.0f} tok/s (min {min(rates[n]):,.0f}, max {max(rates[n]):,.0f}); "
              f"{median / base:.2f}x threads {args.threads[0]}")


if __name__ == "__main__":
    main()
