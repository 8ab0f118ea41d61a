"""The measurement the model-variant benchmarks share (``bench_chunked_loss.py``,
``bench_activation_checkpointing.py``): variants of one model that start from the same weights and batch, each
trained one step at a time (forward, backward, AdamW, fp32) on CPU.

``measure`` takes each variant's first-step loss, then its measured peak (``PeakTracker`` around one real step,
the model state marked first: what a CPU run reports as measured) in a step of its own, then times the variants
in interleaved rounds, outside the peak's step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from ddptrain.plan.memory.trace import StepSetup, trace_step


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
         compute_dtype: torch.dtype | None = None) -> float:
    """One step; ``compute_dtype``: the forward under CPU autocast to it (no loss scaler: timing and memory)."""
    with torch.autocast("cpu", dtype=compute_dtype) if compute_dtype is not None else nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(variants: dict[str, dict], ids: torch.Tensor, repeats: int,
            compute_dtype: torch.dtype | None = None) -> None:
    """Fill each variant (``{"model": ..., "opt": ...}``) with ``loss``, ``peak`` (the ``PeakMemory``) and
    ``times`` (one per round, the variants alternating within a round)."""
    for v in variants.values():  # the first step's loss (same weights, same batch), then AdamW's state exists
        v["loss"] = step(v["model"], v["opt"], ids, compute_dtype)
    for v in variants.values():  # the measured peak, in a step of its own
        tracker, _ = trace_step(v["model"], v["opt"], {"input_ids": ids, "labels": ids},
                                StepSetup("cpu", compute_dtype, 0.0))
        v["peak"], v["times"] = tracker.peak, []
    for _ in range(repeats):
        for v in variants.values():
            start = time.perf_counter()
            step(v["model"], v["opt"], ids, compute_dtype)
            v["times"].append(time.perf_counter() - start)
