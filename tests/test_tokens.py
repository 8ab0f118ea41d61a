"""Which label positions carry loss in padded prompt/completion batches, and how a run weighs its micro batches."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch

from ddptrain.config.choices import DataFormat
from ddptrain.data.types import IGNORE
from ddptrain.train.tokens import loss_tokens
from ddptrain.train.weighting import MEAN_LOSS, TOKEN_MEAN_LOSS, weighting_for


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
