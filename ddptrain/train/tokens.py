"""Exact token-weighted loss over a global batch whose micro batches hold different numbers of loss tokens.

The mean of per-micro-batch means weights a token in a short micro batch more than one in a long one (the
gradient-accumulation bug). Here the loss tokens of the whole global batch (every rank, every micro-step) are
counted first, with one all-reduce, and each micro batch contributes its *summed* token loss scaled by
world_size / total: DDP's average over ranks then leaves exactly grad(sum of token losses) / total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from ddptrain.data.types import IGNORE

MicroBatch = dict[str, torch.Tensor]


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions that carry loss: the causal shift drops the first label of each row; -100 carries none."""
    return (labels[:, 1:] != IGNORE).sum()


def global_loss_tokens(micro_batches: list[MicroBatch]) -> torch.Tensor:
    """Loss tokens of the whole global batch: this rank's count, summed over ranks (one all-reduce)."""
    total = sum((loss_tokens(b["labels"]) for b in micro_batches), torch.zeros((), dtype=torch.long))
    total = total.to(micro_batches[0]["labels"].device)
    if dist.is_initialized():
        dist.all_reduce(total)  # blocking: every rank needs the total before its first backward
    return total


def accumulate_token_weighted(
    module: torch.nn.Module, micro_batches: Iterator[MicroBatch], grad_accum: int,
    maybe_sync: Callable[[bool], AbstractContextManager], autocast: AbstractContextManager,
    phase: Callable[[str], AbstractContextManager],
    loss_guard: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` padded or packed micro batches; the synced ``.grad`` is the global
    token mean.

    Returns this rank's summed token loss x world_size / total, so that the loop's mean of it over ranks is
    the global batch's token-mean loss: the same quantity whose gradient the optimizer steps on.
    """
    with phase("data"):
        batches = [next(micro_batches) for _ in range(grad_accum)]
        total = global_loss_tokens(batches)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # The model's own loss divides its summed token loss by num_items_in_batch; DDP then averages over ranks.
    # use_cache=False: a KV cache would turn off the detection of packed examples (they would attend to each other).
    per_rank_share = total.clamp(min=1).to(torch.float32) / world
    loss_sum: torch.Tensor | None = None
    for micro, batch in enumerate(batches):
        with maybe_sync(micro == grad_accum - 1):
            with phase("forward"), autocast:
                loss = loss_guard(module(**batch, num_items_in_batch=per_rank_share, use_cache=False).loss)
            with phase("backward"):
                scale_loss(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    assert loss_sum is not None
    return loss_sum
