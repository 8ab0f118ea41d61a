"""Measure what each from-scratch DDP engine buys, on this machine, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 scripts/bench_engines.py

Prints (rank 0, markdown): step time of every engine as a ratio to torch DDP on a model of ~500 small tensors
and on llama_tiny; the speed-up of bucketing over one all-reduce per parameter; ring vs native all-reduce bus
bandwidth from 4 KB to 64 MB. Configurations are interleaved in every repeat and each ratio is the median of
per-repeat ratios, so load from other processes moves numerator and denominator together.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.comm import all_reduce_bytes, ring_all_reduce
from ddptrain.engines import DataParallelEngine, build_engine

LossFn = Callable[[nn.Module], torch.Tensor]
# (label, engine name, collective); "torch" is torch DDP, the reference of every ratio
CONFIGS = [
    ("torch DDP", "torch", "native"),
    ("naive", "naive", "native"),
    ("overlap_sync", "overlap_sync", "native"),
    ("overlap_async", "overlap_async", "native"),
    ("bucketed", "bucketed", "native"),
    ("stream_bucketed", "stream_bucketed", "native"),
    ("bucketed, ring", "bucketed", "ring"),
]


class ManySmall(nn.Module):
    """250 residual 32x32 linear layers: 500 parameter tensors of 4 KB or 128 B, about 1 MB in all."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(250))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x


def many_small() -> tuple[nn.Module, LossFn]:
    x = torch.randn(32, 32)
    return ManySmall(), lambda model: model(x).square().mean()


def llama_tiny() -> tuple[nn.Module, LossFn]:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = LlamaConfig(
        vocab_size=8192, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 8192, (4, 128))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def wrap(model: nn.Module, engine: str, collective: str) -> nn.Module:
    if engine == "torch":
        return DistributedDataParallel(model)
    return build_engine(engine, model, collective=collective)


def max_over_ranks(seconds: float) -> float:
    """The slowest rank's time: a data-parallel step ends when the last rank is done."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each function, one figure per repeat; the order rotates from repeat to repeat."""
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            out[name].append(max_over_ranks((time.perf_counter() - start) / calls))
    return out


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median of per-repeat ratios: load that slows one repeat slows both sides of its ratio."""
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


def training_step(model: nn.Module, loss_fn: LossFn, exposed: list[float]) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad()
        if isinstance(model, DataParallelEngine):
            exposed.append(model.comm_stats.exposed_s)

    return step


Timings = dict[str, list[float]]


def bench_engines(build: Callable[[], tuple[nn.Module, LossFn]], repeats: int, steps: int) -> tuple[Timings, Timings]:
    """Seconds per training step of every configuration, and each engine's exposed communication on this rank."""
    torch.manual_seed(0)
    base, loss_fn = build()
    steps_by_label: dict[str, Callable[[], object]] = {}
    exposed: Timings = {}
    for label, engine, collective in CONFIGS:
        exposed[label] = []
        steps_by_label[label] = training_step(wrap(copy.deepcopy(base), engine, collective), loss_fn, exposed[label])
        for _ in range(2):  # warm-up; torch DDP rebuilds its buckets after the first step
            steps_by_label[label]()
        exposed[label].clear()
    return interleaved(steps_by_label, repeats, steps), exposed


def engine_rows(times: Timings, exposed: Timings) -> list[list[str]]:
    ref = times[CONFIGS[0][0]]
    return [
        [
            label,
            f"{statistics.median(t) * 1e3:.1f}",
            f"{median_ratio(t, ref):.2f}",
            f"{statistics.median(exposed[label]) * 1e3:.1f}" if exposed[label] else "-",
        ]
        for label, t in times.items()
    ]


def bench_bucketing(repeats: int, steps: Timings) -> list[list[str]]:
    """ManySmall's gradients averaged with one all-reduce per tensor, or copied into one flat bucket, reduced, copied
    back; then the same comparison on whole training steps (naive vs bucketed engine)."""
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in ManySmall().parameters()]

    def per_parameter() -> None:
        for g in grads:
            dist.all_reduce(g)

    def bucketed() -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    sync = interleaved({"per_parameter": per_parameter, "bucketed": bucketed}, repeats, 3)
    pairs = [
        (f"averaging {len(grads)} gradients alone", sync["per_parameter"], sync["bucketed"]),
        ("training step, naive vs bucketed engine", steps["naive"], steps["bucketed"]),
    ]
    return [
        [
            what,
            f"{statistics.median(per) * 1e3:.2f}",
            f"{statistics.median(buck) * 1e3:.2f}",
            f"{median_ratio(per, buck):.1f}x",
        ]
        for what, per, buck in pairs
    ]


def bench_busbw(repeats: int) -> list[list[str]]:
    """nccl-tests' definitions: algbw = size / time, busbw = algbw · 2(N-1)/N = bytes each rank sends / time."""
    world = dist.get_world_size()
    rows = []
    for size in [4 << 10 << 2 * k for k in range(8)]:  # 4 KB, 16 KB, ..., 64 MB
        x = torch.randn(size // 4)
        calls = min(200, max(2, (32 << 20) // size))  # about 32 MB per timing, within 2 to 200 calls
        t = interleaved(
            {"native": functools.partial(dist.all_reduce, x), "ring": functools.partial(ring_all_reduce, x)},
            repeats,
            calls,
        )
        busbw = {name: [all_reduce_bytes(size, world) / s for s in t[name]] for name in t}
        gbs = [f"{statistics.median(busbw[name]) / 1e9:.2f}" for name in ("native", "ring")]
        rows.append([_size(size), *gbs, f"{median_ratio(busbw['ring'], busbw['native']):.2f}"])
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per figure (median taken)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timing")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        engine_header = ["engine", "step (ms)", "ratio to torch DDP", "exposed comm, rank 0 (ms)"]
        a = bench_engines(many_small, args.repeats, args.steps)
        b = bench_engines(llama_tiny, args.repeats, args.steps)
        out = [
            f"world size {world}, gloo, {torch.get_num_threads()} thread(s) per rank, torch {torch.__version__}, "
            f"medians of {args.repeats} interleaved repeats\n",
            table("(a) ManySmall, 500 tensors, 1.1 MB of gradients", engine_header, engine_rows(*a)),
            table("(b) llama_tiny, 4 x 128 tokens per rank", engine_header, engine_rows(*b)),
            table(
                "Bucketing vs one all-reduce per parameter, on ManySmall",
                ["what", "per-parameter (ms)", "bucketed (ms)", "bucketing speed-up"],
                bench_bucketing(args.repeats, a[0]),
            ),
            table(
                "All-reduce bus bandwidth (busbw = algbw · 2(N-1)/N)",
                ["size", "native busbw (GB/s)", "ring busbw (GB/s)", "ring / native"],
                bench_busbw(args.repeats),
            ),
        ]
        if dist.get_rank() == 0:
            print("\n".join(out), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
