"""Padding-free micro batches for prompt/completion data: a micro batch's examples packed into few rows.

Each micro batch's examples (the very ones the padded path would batch) are packed best-fit-decreasing into
rows of at most ``data.seq_len`` tokens. ``position_ids`` restart at 0 for every example, and no attention mask
is passed: transformers then derives a block-diagonal causal mask from the restarts (sdpa, eager, flex) or runs
FlashAttention's varlen kernels, so no example attends to another. Two things turn that detection off and let
attention leak across examples: any 2-D ``attention_mask`` (even all ones) and a KV cache (``use_cache`` left at
the config default); the training and evaluation forwards pass neither.

Labels are -100 on prompts (as padded) and on each example's first token, so the last token of one example is
never trained to predict the first of the next; the loss tokens of a micro batch are those of the padded path.

Each batch also carries FlashAttention's varlen arguments, computed here on the host where the lengths are known:
``cu_seq_lens_q/k`` (int32 offsets of every segment in the row-major flattened tokens) and ``max_length_q/k``
(Python ints). transformers' FlashAttention-2 path takes its varlen kernel whenever they are given, for any number
of rows; without them it infers segments from ``position_ids`` only for a single row and runs causal attention
per row otherwise, letting the examples of a row see each other. Other attention implementations ignore them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.data.types import IGNORE

REAL_TOKENS = "real_tokens"  # a collate's count of the non-padding tokens it holds; popped before the forward
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # transformers' FA2 kwargs
# ... and the sum of its examples' squared lengths: the token pairs causal attention relates within each example
# (the FLOPs counted for attention, never seq_len² per row); popped before the forward too
SEGMENT_SQUARES = "segment_squares"
COUNTS = (REAL_TOKENS, SEGMENT_SQUARES)  # what a collate counts for the metrics, not model inputs


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each into the fullest
    bin it still fits (a new bin if none). Deterministic: ties keep the original order."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"an example of {lengths[i]} tokens exceeds the row capacity of {capacity}")
        fits = [b for b, room in enumerate(free) if room >= lengths[i]]
        if fits:
            best = min(fits, key=lambda b: free[b])
            bins[best].append(i)
            free[best] -= lengths[i]
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


@dataclass(frozen=True)
class PackCollate:
    """Packs one micro batch's examples into rows of at most ``seq_len`` tokens, padded to the fullest row.

    Returns ``input_ids``, ``position_ids`` and ``labels`` (no ``attention_mask``), FlashAttention's varlen
    arguments (``VARLEN_KEYS``), the count of real tokens under ``REAL_TOKENS`` and the sum of the examples'
    squared lengths under ``SEGMENT_SQUARES``. A row's padding tail is a segment of its own (positions from 0,
    labels -100), counted in neither.
    """

    pad_id: int
    seq_len: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(r["input_ids"]) for r in rows]
        bins = best_fit_decreasing(lengths, self.seq_len)
        width = max(sum(lengths[i] for i in b) for b in bins)
        ids = torch.full((len(bins), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(bins), width), IGNORE, dtype=torch.long)
        positions = torch.zeros((len(bins), width), dtype=torch.long)
        segments: list[int] = []  # every segment's length, row after row: the flattened tokens' layout
        for r, members in enumerate(bins):
            start = 0
            for i in members:
                n = lengths[i]
                ids[r, start : start + n] = torch.as_tensor(rows[i]["input_ids"])
                labels[r, start : start + n] = torch.as_tensor(rows[i]["labels"])
                labels[r, start] = IGNORE  # the previous example's last token must not learn to predict it
                positions[r, start : start + n] = torch.arange(n)
                start += n
                segments.append(n)
            positions[r, start:] = torch.arange(width - start)
            if start < width:
                segments.append(width - start)
        return {"input_ids": ids, "position_ids": positions, "labels": labels, **varlen_arguments(segments),
                REAL_TOKENS: torch.tensor(sum(lengths)), SEGMENT_SQUARES: torch.tensor(sum(n * n for n in lengths))}


def varlen_arguments(segments: Sequence[int]) -> dict[str, Any]:
    """transformers' FlashAttention varlen kwargs for consecutive segments of these lengths (on the host). The
    query and key offsets are equal but two tensors: Dynamo cannot trace an autograd.Function handed one tensor as
    two inputs (flash-attn's varlen function takes both), and would break each compiled block's graph there."""
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), 0)
    longest = max(segments)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": longest, "max_length_k": longest}


def to_device(batch: dict[str, Any], device: torch.device, non_blocking: bool = False) -> dict[str, Any]:
    """A micro batch on ``device``: its tensors moved (a tensor under two keys, once), its Python values (the
    varlen maximum lengths) kept."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            if id(v) not in moved:
                moved[id(v)] = v.to(device, non_blocking=non_blocking)
            v = moved[id(v)]
        out[k] = v
    return out
