"""Chunked vs full-logits loss (``train.chunked_loss``) on CPU: measured peak memory, step time, the loss, and
the head bytes each chunk moves, in fp32 and under bf16/fp16 autocast with a trainable head.

For each (vocabulary, sequence length, micro batch) and precision a Qwen3-shaped tiny model
(``configs/model/qwen3_tiny.yaml``: width 128, 4 blocks, tied embeddings, so the head is trained) trains one step
at a time, forward, backward and AdamW; bf16/fp16 run the forward under CPU autocast (fp32 weights, as a run's
mixed precision; fp16 without a loss scaler: timing and memory only). The two variants start from the same
weights and batch and alternate (interleaved repeats, median time). The peak is the one a CPU run reports as
measured (``PeakTracker`` around one real step, the model state marked first), taken once per variant in a step
of its own, outside the timed ones. The head bytes per chunk are counted, not timed: the bytes the chunked
loss's ops read and write in tensors shaped like the head's weight, ``[vocab, hidden]``, per chunk of a forward
and backward (``tests/helpers/chunks.py``: a dispatch mode; deterministic), as a multiple of vocab x hidden.

    PYTHONPATH=. python scripts/bench_chunked_loss.py                      # every case (slow on a loaded machine)
    PYTHONPATH=. python scripts/bench_chunked_loss.py --cases 151936:256:4 --precisions bf16 --repeats 3
    PYTHONPATH=. python scripts/bench_chunked_loss.py --head-bytes-only    # the counted bytes alone (seconds)
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
from tests.helpers.chunks import head_bytes_per_chunk

QWEN3_TINY = ModelConfig(name="qwen3_tiny", arch="qwen3", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=32, intermediate_size=384, max_position_embeddings=2048, rope_theta=1e6)
CASES = ["151936:256:4", "32000:512:4", "151936:512:4", "32000:2048:1", "151936:2048:1"]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MiB = 1024**2


def run_case(vocab: int, seq: int, micro: int, precision: str, repeats: int) -> dict:
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
    measure(variants, ids, repeats, PRECISIONS[precision])
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


def head_bytes(vocab: int, precision: str) -> str:
    """``per chunk / per call besides the chunks``, as multiples of vocab x hidden (a trainable fp32 head)."""
    per_chunk, per_call = head_bytes_per_chunk(vocab, QWEN3_TINY.hidden_size, PRECISIONS[precision] or torch.float32)
    head = vocab * QWEN3_TINY.hidden_size
    return f"{per_chunk / head:g} / {per_call / head:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=CASES, help="vocab:seq:micro_batch")
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--head-bytes-only", action="store_true", help="print the counted head bytes and exit")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()} | load average {os.getloadavg()}")
    if args.head_bytes_only:
        print("| precision | head bytes per chunk / per call besides the chunks (x vocab x hidden) |\n|---|---|")
        for precision in args.precisions:
            print(f"| {precision} | {head_bytes(4096, precision)} |", flush=True)
        return
    print("| vocab | seq x micro batch | precision | chunk | peak full | peak chunked | ratio | logits+loss full "
          "| chunked | step full | step chunked | time ratio (median of pairs) | loss rel. diff "
          "| head bytes per chunk / per call (x V x H) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        vocab, seq, micro = map(int, case.split(":"))
        for precision in args.precisions:
            r = run_case(vocab, seq, micro, precision, args.repeats)
            print(f"| {vocab:,} | {seq} x {micro} | {precision} | {r['chunk']} | {r['full_peak_mib']:,.0f} MiB "
                  f"| {r['chunked_peak_mib']:,.0f} MiB | {r['peak_ratio']:.2f} | {r['full_logits_mib']:,.0f} MiB "
                  f"| {r['chunked_logits_mib']:,.0f} MiB | {r['full_s']:.2f} s | {r['chunked_s']:.2f} s "
                  f"| {r['time_ratio']:.2f} | {r['loss_rel']:.1e} | {head_bytes(vocab, precision)} |", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
