"""Chunked vs full-logits loss (``train.chunked_loss``) on CPU: measured peak memory, step time and the loss.

For each (vocabulary, sequence length, micro batch) a Qwen3-shaped tiny model (``configs/model/qwen3_tiny.yaml``:
width 128, 4 blocks, tied embeddings) trains one step at a time, forward, backward and AdamW, fp32. The two
variants start from the same weights and batch and alternate (interleaved repeats, median time). The peak is the
one a CPU run reports as measured (``PeakTracker`` around one real step, the model state marked first), taken
once per variant in a step of its own, outside the timed ones.

    python scripts/bench_chunked_loss.py                      # every case (slow on a loaded 2-core machine)
    python scripts/bench_chunked_loss.py --cases 151936:256:4 --repeats 3
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

QWEN3_TINY = ModelConfig(name="qwen3_tiny", arch="qwen3", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=32, intermediate_size=384, max_position_embeddings=2048, rope_theta=1e6)
CASES = ["151936:256:4", "32000:512:4", "151936:512:4", "32000:2048:1", "151936:2048:1"]
MiB = 1024**2


def run_case(vocab: int, seq: int, micro: int, repeats: int) -> dict:
    cfg = QWEN3_TINY.__class__(**{**QWEN3_TINY.__dict__, "vocab_size": vocab})
    torch.manual_seed(0)
    base = build_model(cfg, vocab, eos_id=0)
    ids = torch.randint(0, vocab, (micro, seq), generator=torch.Generator().manual_seed(1))
    variants = {}
    for name in ("full", "chunked"):
        model = copy.deepcopy(base)
        chunk = use_chunked_loss(model, None) if name == "chunked" else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        variants[name] = {"model": model, "opt": optimizer, "chunk": chunk}
    measure(variants, ids, repeats)
    for v in variants.values():
        v["peak"], v["logits"] = v["peak"].peak, v["peak"].by_category.get("logits and loss", 0)
    full, chunked = variants["full"], variants["chunked"]
    return {
        "vocab": vocab, "seq": seq, "micro": micro, "chunk": chunked["chunk"],
        "full_peak_mib": full["peak"] / MiB, "chunked_peak_mib": chunked["peak"] / MiB,
        "full_logits_mib": full["logits"] / MiB, "chunked_logits_mib": chunked["logits"] / MiB,
        "peak_ratio": chunked["peak"] / full["peak"],
        "full_s": statistics.median(full["times"]), "chunked_s": statistics.median(chunked["times"]),
        "time_ratio": statistics.median(c / f for c, f in zip(chunked["times"], full["times"], strict=True)),
        "loss_rel": abs(chunked["loss"] - full["loss"]) / abs(full["loss"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=CASES, help="vocab:seq:micro_batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()} | load average {os.getloadavg()}")
    print("| vocab | seq x micro batch | chunk | peak full | peak chunked | ratio | logits+loss full | chunked "
          "| step full | step chunked | time ratio (median of pairs) | loss rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        vocab, seq, micro = map(int, case.split(":"))
        r = run_case(vocab, seq, micro, args.repeats)
        print(f"| {vocab:,} | {seq} x {micro} | {r['chunk']} | {r['full_peak_mib']:,.0f} MiB "
              f"| {r['chunked_peak_mib']:,.0f} MiB | {r['peak_ratio']:.2f} | {r['full_logits_mib']:,.0f} MiB "
              f"| {r['chunked_logits_mib']:,.0f} MiB | {r['full_s']:.2f} s | {r['chunked_s']:.2f} s "
              f"| {r['time_ratio']:.2f} | {r['loss_rel']:.1e} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
