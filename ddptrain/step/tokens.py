"""Loss tokens: the positions that carry loss in a prompt/completion batch, and their count over a global batch
(what the token-mean weighting, ``step/weighting.py``, and the evaluation divide by)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddptrain.data.types import IGNORE

MicroBatch = dict[str, torch.Tensor]


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions that carry loss: the causal shift drops the first label of each row; -100 carries none."""
    return (labels[:, 1:] != IGNORE).sum()


def global_loss_tokens(micro_batches: list[MicroBatch], over_ranks: bool = True) -> torch.Tensor:
    """Loss tokens of the whole global batch: this rank's count, summed over ranks (one all-reduce).
    ``over_ranks=False``: this rank's micro batches are the whole batch (one rank's step, as the memory plan
    traces it on fake tensors): no collective."""
    total = sum((loss_tokens(b["labels"]) for b in micro_batches), torch.zeros((), dtype=torch.long))
    total = total.to(micro_batches[0]["labels"].device)
    if over_ranks and dist.is_initialized():
        dist.all_reduce(total)  # blocking: every rank needs the total before its first backward
    return total
