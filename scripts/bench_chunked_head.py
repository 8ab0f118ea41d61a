"""The chunked loss's head alone at a real model's size, on one CUDA device: full logits against chunks of several
sizes, for a trainable and a frozen head, under bf16 (or fp16) autocast.

This is the measurement behind ``CUDA_CHUNK_TOKENS`` (``ddptrain/models/chunked_loss.py``): the chunk that keeps
the head's matmuls compute-bound. Each variant computes the causal-LM loss of ``hidden`` ``[tokens, H]`` through
the head ``[V, H]`` and its backward (the gradients of ``hidden`` and, for a trainable head, of the weight), from
the same inputs. The full-logits variant is what transformers does: the logits in the autocast dtype, upcast to
fp32, cross-entropy. Variants alternate in every repeat (interleaved; the median of each is printed, and the
time as a ratio to full logits, the median of per-repeat ratios). Peak is ``torch.cuda.max_memory_allocated``
above what was allocated before the variant ran (inputs and weight excluded). The loss and the gradients are
compared with full logits' (relative difference of the loss; max abs difference of the hidden gradient over its
max abs value).

    python scripts/bench_chunked_head.py                        # CUDA: Qwen3-4B's head (151,936 x 2,560), 8,192 tokens
    python scripts/bench_chunked_head.py --vocab 32000 --hidden 4096 --tokens 16384
    python scripts/bench_chunked_head.py --smoke                 # CPU, tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from bench_kernels import seconds_per_call  # scripts/, beside this file

from ddptrain.models.chunked_loss import chunk_tokens_for, linear_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MiB = 1024**2


def full_logits_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' path: logits in the autocast dtype, upcast, then the shifted mean cross-entropy."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def chunked_loss(chunk: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, None, chunk)
    return loss


def run_head(hidden0: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype,
             chunks: Sequence[int], repeats: int) -> list[dict]:
    """Every variant with ``weight`` trainable or frozen (as its ``requires_grad`` says): one row each."""
    device, trainable = hidden0.device, weight.requires_grad
    variants: dict[str, Callable] = {"full logits": full_logits_loss}
    for chunk in chunks:
        variants[f"chunk {chunk}"] = chunked_loss(chunk)
    results: dict[str, dict] = {name: {"times": []} for name in variants}

    def step(name: str, keep: bool = False) -> None:
        hidden = hidden0.detach().requires_grad_(True)
        weight.grad = None
        with torch.autocast(device.type, dtype=dtype):
            loss = variants[name](hidden, weight, labels)
        loss.backward()
        if keep:
            results[name]["loss"] = float(loss.detach())
            results[name]["grad_h"] = hidden.grad.float().cpu()
            results[name]["grad_w"] = weight.grad.float().cpu() if trainable else None

    for name in variants:  # warm-up, the values compared, and the peak, each variant alone
        step(name, keep=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            weight.grad = None
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(name)
            torch.cuda.synchronize()
            results[name]["peak"] = torch.cuda.max_memory_allocated() - before
    for _ in range(repeats):
        for name in variants:
            results[name]["times"].append(seconds_per_call(lambda name=name: step(name), 1, device))
    full = results["full logits"]
    rows = []
    for name, r in results.items():
        grad_h = (r["grad_h"] - full["grad_h"]).abs().max() / full["grad_h"].abs().max()
        grad_w = ((r["grad_w"] - full["grad_w"]).abs().max() / full["grad_w"].abs().max()
                  if trainable else torch.tensor(0.0))
        rows.append({
            "head": "trainable" if trainable else "frozen", "variant": name,
            "time_s": statistics.median(r["times"]),
            "ratio": statistics.median(t / f for t, f in zip(r["times"], full["times"], strict=True)),
            "peak_mib": r["peak"] / MiB if "peak" in r else None,
            "loss_rel": abs(r["loss"] - full["loss"]) / abs(full["loss"]),
            "grad_rel": max(float(grad_h), float(grad_w)),
        })
    return rows


def run(vocab: int, hidden_size: int, tokens: int, dtype: torch.dtype, chunks: Sequence[int], repeats: int,
        device: torch.device) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    # a trained model's scale: hidden states ~N(0, 1), head weights ~N(0, 0.02); fp32 master weights, as a run has
    hidden0 = torch.randn(1, tokens, hidden_size, generator=gen).to(device)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.02).to(device)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
    rows = []
    for trainable in (True, False):
        rows += run_head(hidden0, weight.requires_grad_(trainable), labels, dtype, chunks, repeats)
    return rows


def table(rows: list[dict], vocab: int, hidden_size: int, tokens: int) -> str:
    flops = 2 * tokens * vocab * hidden_size  # one matmul
    out = ["| head | variant | time | vs full logits | TFLOP/s (matmuls) | peak above inputs | loss rel. diff "
           "| grad rel. diff |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        matmuls = 3 if r["head"] == "trainable" else 2  # logits, hidden-state gradient, weight gradient
        peak = f"{r['peak_mib']:,.0f} MiB" if r["peak_mib"] is not None else "n/a"
        out.append(f"| {r['head']} | {r['variant']} | {r['time_s'] * 1e3:.2f} ms | {r['ratio']:.2f} "
                   f"| {matmuls * flops / r['time_s'] / 1e12:.0f} | {peak} | {r['loss_rel']:.1e} "
                   f"| {r['grad_rel']:.1e} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--chunks", type=int, nargs="*", default=None,
                        help="tokens per chunk (default: 64 MiB's, 256, 512, 1,024, 2,048)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, 1 repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        device, args.vocab, args.hidden, args.tokens, args.repeats = torch.device("cpu"), 512, 32, 64, 1
        chunks = args.chunks or [16, 64]
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (or --smoke)")
        device = torch.device("cuda", 0)
        chunks = args.chunks or sorted({chunk_tokens_for(args.vocab), 256, 512, 1024, 2048})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = f"{name} | torch {torch.__version__} | V {args.vocab:,} x H {args.hidden:,}, {args.tokens:,} tokens, " \
           f"{args.dtype} autocast, fp32 weight | {args.repeats} interleaved repeats, median"
    rows = run(args.vocab, args.hidden, args.tokens, DTYPES[args.dtype], chunks, args.repeats, device)
    text = head + "\n\n" + table(rows, args.vocab, args.hidden, args.tokens)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
