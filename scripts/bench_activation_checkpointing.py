"""Activation checkpointing modes (``model.activation_checkpointing``) on CPU: measured peak memory and step time.

For each (width, blocks, sequence length, micro batch) a Llama-shaped model (vocabulary 8,192, chunked loss as a
run uses it by default) trains one step at a time, forward, backward and AdamW, fp32, under none, selective and
full checkpointing. The three start from the same weights and batch and alternate (interleaved repeats, median
time; each mode's time ratio is the median of its per-round ratios to none). The peak is the one a CPU run reports
as measured (``PeakTracker`` around one real step, the model state marked first), taken once per mode in a step
of its own, outside the timed ones; "activations" is that peak's activation category.

    PYTHONPATH=. python scripts/bench_activation_checkpointing.py                 # every case
    PYTHONPATH=. python scripts/bench_activation_checkpointing.py --cases 512:4:512:4 --repeats 5

``--suite host``: what each mode costs the host per transformer block, where compute is negligible (width 64,
16 tokens): forward + backward of models 2 and 6 blocks deep, every variant alternating within a round (median
of the rounds); per block = the slope between the two depths (the embeddings, head and loss cancel), ops per
block likewise from the aten ops a dispatch mode counts in one step, and host time per op = the two slopes'
ratio. ``--compile`` adds none and selective with every block compiled (``compile_blocks``, as
``train.compile=true``; their compilation runs before the timed rounds and is reported apart; ops are not
counted inside compiled graphs).

    PYTHONPATH=. python scripts/bench_activation_checkpointing.py --suite host --repeats 21 [--compile]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
from bench_variants import measure  # scripts/, beside this file
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.config.schema import ModelConfig
from ddptrain.models import build_model
from ddptrain.models.chunked_loss import use_chunked_loss
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.parallel.compile import compile_blocks

VOCAB = 8192
MODES = ("none", "selective", "full")
CASES = ["256:4:512:4", "512:4:512:4", "512:4:1024:2"]
MiB = 1024**2


def run_case(width: int, blocks: int, seq: int, micro: int, repeats: int) -> dict[str, dict]:
    cfg = ModelConfig(hidden_size=width, num_layers=blocks, num_heads=width // 64, max_position_embeddings=seq)
    torch.manual_seed(0)
    base = build_model(cfg, VOCAB, eos_id=0)
    ids = torch.randint(0, VOCAB, (micro, seq), generator=torch.Generator().manual_seed(1))
    variants: dict[str, dict] = {}
    for mode in MODES:
        mode_cfg = ModelConfig(**{**cfg.__dict__, "activation_checkpointing": mode})
        model = prepare_for_finetuning(copy.deepcopy(base), mode_cfg)
        use_chunked_loss(model, None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        variants[mode] = {"model": model, "opt": optimizer}
    measure(variants, ids, repeats)
    for v in variants.values():
        v["peak"], v["activations"] = v["peak"].peak, v["peak"].by_category["activations"]
    none = variants["none"]
    for v in variants.values():
        v["time_ratio"] = statistics.median(t / n for t, n in zip(v["times"], none["times"], strict=True))
        v["loss_rel"] = abs(v["loss"] - none["loss"]) / abs(none["loss"])
    return variants


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched (forward, backward and any recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


HOST_WIDTH, HOST_SEQ, HOST_VOCAB, HOST_DEPTHS = 64, 16, 256, (2, 6)


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for p in model.parameters():
        p.grad = None


def host_variants(compiled: bool) -> dict[tuple[str, int], dict]:
    """(variant, depth) -> its model; compiled variants compiled and warmed (time recorded)."""
    variants: dict[tuple[str, int], dict] = {}
    names = [*MODES, *(("none+compile", "selective+compile") if compiled else ())]
    ids = torch.randint(0, HOST_VOCAB, (1, HOST_SEQ), generator=torch.Generator().manual_seed(1))
    for depth in HOST_DEPTHS:
        cfg = ModelConfig(hidden_size=HOST_WIDTH, num_layers=depth, num_heads=2, num_kv_heads=2,
                          intermediate_size=4 * HOST_WIDTH, max_position_embeddings=HOST_SEQ)
        torch.manual_seed(0)
        base = build_model(cfg, HOST_VOCAB, eos_id=0)
        for name in names:
            mode = name.removesuffix("+compile")
            model = prepare_for_finetuning(copy.deepcopy(base), ModelConfig(**{**cfg.__dict__,
                                                                             "activation_checkpointing": mode}))
            use_chunked_loss(model, None)
            model.train()
            variant: dict = {"model": model, "times": [], "ops": None, "compile_s": None}
            start = time.perf_counter()
            if name.endswith("+compile"):
                compile_blocks(model)
            for _ in range(3):  # warm up (compiles the compiled ones, forward and backward)
                forward_backward(model, ids)
            if name.endswith("+compile"):
                variant["compile_s"] = time.perf_counter() - start
            else:
                with OpCount() as counter:
                    forward_backward(model, ids)
                variant["ops"] = counter.ops
            variants[name, depth] = variant
    return variants


def run_host(repeats: int, compiled: bool) -> None:
    variants = host_variants(compiled)
    ids = torch.randint(0, HOST_VOCAB, (1, HOST_SEQ), generator=torch.Generator().manual_seed(1))
    for _ in range(repeats):
        for v in variants.values():
            start = time.perf_counter()
            forward_backward(v["model"], ids)
            v["times"].append(time.perf_counter() - start)
    low, high = HOST_DEPTHS
    names = list(dict.fromkeys(name for name, _ in variants))
    per_block = {n: (statistics.median(variants[n, high]["times"]) - statistics.median(variants[n, low]["times"]))
                 / (high - low) for n in names}
    print(f"width {HOST_WIDTH}, {HOST_SEQ} tokens, micro batch 1, fp32, forward + backward, depths {HOST_DEPTHS}, "
          f"{repeats} rounds | torch threads {torch.get_num_threads()}")
    print("| variant | step at 2 blocks | step at 6 blocks | host time per block | vs none | aten ops per block "
          "| host time per op | compile (both depths' warm-up) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        lo, hi = variants[n, low], variants[n, high]
        ops = None if lo["ops"] is None else (hi["ops"] - lo["ops"]) / (high - low)
        per_op = "-" if ops is None else f"{per_block[n] / ops * 1e6:.0f} µs"
        compile_s = "-" if lo["compile_s"] is None else f"{lo['compile_s'] + hi['compile_s']:.0f} s"
        print(f"| {n} | {statistics.median(lo['times']) * 1e3:.1f} ms | {statistics.median(hi['times']) * 1e3:.1f} ms "
              f"| {per_block[n] * 1e3:.2f} ms | {per_block[n] / per_block['none']:.2f} "
              f"| {'-' if ops is None else f'{ops:.0f}'} | {per_op} | {compile_s} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["memory", "host"], default="memory")
    parser.add_argument("--cases", nargs="*", default=CASES, help="width:blocks:seq:micro_batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="--suite host: add compiled none and selective")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()} | load average {os.getloadavg()}")
    if args.suite == "host":
        run_host(args.repeats, args.compile)
        print(f"load average after: {os.getloadavg()}")
        return
    print("| width x blocks | seq x micro batch | mode | peak | vs none | activations | vs none | step (median) "
          "| time vs none (median of pairs) | loss rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        width, blocks, seq, micro = map(int, case.split(":"))
        variants = run_case(width, blocks, seq, micro, args.repeats)
        none = variants["none"]
        for mode, v in variants.items():
            print(f"| {width} x {blocks} | {seq} x {micro} | {mode} | {v['peak'] / MiB:,.0f} MiB "
                  f"| {v['peak'] / none['peak']:.2f} | {v['activations'] / MiB:,.0f} MiB "
                  f"| {v['activations'] / none['activations']:.2f} | {statistics.median(v['times']):.2f} s "
                  f"| {v['time_ratio']:.2f} | {v['loss_rel']:.1e} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
