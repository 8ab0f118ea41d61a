"""Which label positions carry loss in padded prompt/completion batches, and how a run weighs its micro batches."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddptrain.config.choices import DataFormat
from ddptrain.data.types import IGNORE
from ddptrain.step.tokens import loss_tokens
from ddptrain.step.weighting import MEAN_LOSS, TOKEN_MEAN_LOSS, weighting_for


def test_the_first_label_of_each_row_carries_no_loss_and_ignored_ones_none() -> None:
    """The causal shift predicts label t from tokens before t: a row's first label has nothing before it."""
    labels = torch.tensor([[5, 6, IGNORE, 7], [8, IGNORE, IGNORE, IGNORE]])
    assert int(loss_tokens(labels)) == 2  # 6 and 7; the 5 and the 8 open their rows


def test_a_run_weighs_prompt_completion_batches_by_loss_token_and_packed_blocks_by_micro_batch() -> None:
    """The weighting is picked once from data.format; packed blocks: each micro batch's mean over grad_accum;
    prompt/completion: the summed token loss over the global batch's loss tokens (one process: all of them)."""
    assert weighting_for(DataFormat.prompt_completion) is TOKEN_MEAN_LOSS
    assert weighting_for(DataFormat.packed) is MEAN_LOSS
    divisors: list[Any] = []

    def module(**inputs: Any) -> SimpleNamespace:
        divisors.append(inputs.get("num_items_in_batch"))
        return SimpleNamespace(loss=torch.tensor(6.0))

    untimed = lambda _: nullcontext()  # noqa: E731
    blocks = iter([torch.zeros(1, 4, dtype=torch.long)] * 3)
    assert [float(f(module)) for f in MEAN_LOSS.micro_losses(blocks, 3, untimed)] == [2.0, 2.0, 2.0]
    assert divisors == [None] * 3
    rows = iter([{"labels": torch.tensor([[IGNORE, 1, 2]])}, {"labels": torch.tensor([[IGNORE, IGNORE, 3, 4, 5]])}])
    assert [float(f(module)) for f in TOKEN_MEAN_LOSS.micro_losses(rows, 2, untimed)] == [6.0, 6.0]
    assert [float(d) for d in divisors[3:]] == [5.0, 5.0]  # 2 + 3 loss tokens in the global batch


def test_the_memory_plans_one_rank_step_counts_its_own_loss_tokens_without_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memory plan traces one rank's step on fake tensors, in a run by rank 0 alone (its summary) or by every
    rank for itself (``data.micro_batch_size=auto``): the token count of ``weighting_for(..., one_rank=True)`` is
    this rank's, with no all-reduce, which would wait for ranks that are not counting (or carry no data: fake)."""
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a process group of 2, as in a run
    monkeypatch.setattr(dist, "get_world_size", lambda *_: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *_, **__: reduced.append(t))
    divisors: list[Any] = []

    def module(**inputs: Any) -> SimpleNamespace:
        divisors.append(float(inputs["num_items_in_batch"]))
        return SimpleNamespace(loss=torch.tensor(6.0))

    untimed = lambda _: nullcontext()  # noqa: E731
    rows = [{"labels": torch.tensor([[IGNORE, 1, 2]])}, {"labels": torch.tensor([[IGNORE, IGNORE, 3, 4, 5]])}]
    one_rank = weighting_for(DataFormat.prompt_completion, one_rank=True)
    assert weighting_for(DataFormat.packed, one_rank=True) is MEAN_LOSS
    [f(module) for f in one_rank.micro_losses(iter(rows), 2, untimed)]
    assert reduced == [] and divisors == [5.0, 5.0]  # this rank's 5 loss tokens, as in a one-rank run
    [f(module) for f in TOKEN_MEAN_LOSS.micro_losses(iter(rows), 2, untimed)]
    assert len(reduced) == 1 and divisors[2:] == [2.5, 2.5]  # the run's: over every rank (here, itself twice)
