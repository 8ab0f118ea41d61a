"""How a step's micro batches are weighted into its gradient, chosen once when the run is built.

``MeanLoss`` (packed blocks, every micro batch as many loss tokens): each micro batch's mean loss / grad_accum, so
the synced ``.grad`` is the mean over the global batch. ``TokenMeanLoss`` (prompt/completion batches, padded or
packed): the mean over every loss token of the global batch, whose micro batches hold different numbers of them.
The mean of per-micro-batch means would weight a token in a short micro batch more than one in a long one (the
gradient-accumulation bug); here the loss tokens of the whole global batch (every rank, every micro-step) are
counted first, with one all-reduce, and each micro batch contributes its *summed* token loss scaled by
world_size / total: DDP's average over ranks then leaves exactly grad(sum of token losses) / total.

Both give the step loop (``step/compute.py``) one loss function per micro batch; the loop runs forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddptrain.config.choices import DataFormat
from ddptrain.step.tokens import MicroBatch, global_loss_tokens

MicroLoss = Callable[[torch.nn.Module], torch.Tensor]  # one micro batch's forward: its weighted loss
Phase = Callable[[str], AbstractContextManager]  # the step timer's phase (time spent inside counts in it)


class Weighting(Protocol):
    def micro_losses(self, micro_batches: Iterator[Any], grad_accum: int, phase: Phase) -> Iterator[MicroLoss]:
        """The ``grad_accum`` micro batches' forwards, each returning its share of the step's loss."""
        ...


class MeanLoss:
    """Packed blocks: each micro batch's mean loss / grad_accum; the step's loss is this rank's mean."""

    def micro_losses(self, micro_batches: Iterator[torch.Tensor], grad_accum: int, phase: Phase
                     ) -> Iterator[MicroLoss]:
        for _ in range(grad_accum):
            with phase("data"):
                ids = next(micro_batches)
            yield lambda module, ids=ids: module(input_ids=ids, labels=ids, use_cache=False).loss / grad_accum


@dataclass(frozen=True)
class TokenMeanLoss:
    """Prompt/completion batches: the step's gradient is the global batch's token mean.

    Each micro batch's loss is its summed token loss x world_size / total, so that the loop's mean of the step's
    loss over ranks is the global batch's token-mean loss: the same quantity whose gradient the optimizer steps on.
    ``over_ranks=False``: this rank's micro batches are the whole global batch, counted without a collective (the
    memory plan's step, one rank's on fake tensors, traced by one rank while the others wait or trace their own).
    """

    over_ranks: bool = True

    def micro_losses(self, micro_batches: Iterator[MicroBatch], grad_accum: int, phase: Phase
                     ) -> Iterator[MicroLoss]:
        with phase("data"):
            batches = [next(micro_batches) for _ in range(grad_accum)]
            total = global_loss_tokens(batches, self.over_ranks)
        world = dist.get_world_size() if self.over_ranks and dist.is_initialized() else 1
        # The model's own loss divides its summed token loss by num_items_in_batch; DDP then averages over ranks.
        # use_cache=False: a KV cache would turn off the detection of packed examples (they would attend to each
        # other).
        per_rank_share = total.clamp(min=1).to(torch.float32) / world
        for batch in batches:
            yield lambda module, batch=batch: module(**batch, num_items_in_batch=per_rank_share,
                                                     use_cache=False).loss


MEAN_LOSS, TOKEN_MEAN_LOSS = MeanLoss(), TokenMeanLoss()  # stateless: one of each serves every run
ONE_RANK_TOKEN_MEAN_LOSS = TokenMeanLoss(over_ranks=False)


def weighting_for(data_format: DataFormat, one_rank: bool = False) -> Weighting:
    """The run's weighting: the token mean for prompt/completion data, else the mean over micro batches.
    ``one_rank``: the token mean of this rank's micro batches alone, with no collective (the memory plan's step)."""
    if data_format != DataFormat.prompt_completion:
        return MEAN_LOSS
    return ONE_RANK_TOKEN_MEAN_LOSS if one_rank else TOKEN_MEAN_LOSS
