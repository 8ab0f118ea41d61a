"""Activation checkpointing modes (``model.activation_checkpointing``) on CPU: measured peak memory and step time.

For each (width, blocks, sequence length, micro batch) a Llama-shaped model (vocabulary 8,192, chunked loss as a
run uses it by default) trains one step at a time, forward, backward and AdamW, fp32, under none, selective and
full checkpointing. The three start from the same weights and batch and alternate (interleaved repeats, median
time; each mode's time ratio is the median of its per-round ratios to none). The peak is the one a CPU run reports
as measured (``PeakTracker`` around one real step, the model state marked first), taken once per mode in a step
of its own, outside the timed ones; "activations" is that peak's activation category.

    PYTHONPATH=. python scripts/bench_activation_checkpointing.py                 # every case
    PYTHONPATH=. python scripts/bench_activation_checkpointing.py --cases 512:4:512:4 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
from bench_variants import measure  # scripts/, beside this file

from ddptrain.config.schema import ModelConfig
from ddptrain.models import build_model
from ddptrain.models.chunked_loss import use_chunked_loss
from ddptrain.models.lora import prepare_for_finetuning

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=CASES, help="width:blocks:seq:micro_batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()} | load average {os.getloadavg()}")
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
