"""Which label positions carry loss in padded prompt/completion batches."""

from __future__ import annotations

import torch

from ddptrain.data.types import IGNORE
from ddptrain.train.tokens import loss_tokens


def test_the_first_label_of_each_row_carries_no_loss_and_ignored_ones_none() -> None:
    """The causal shift predicts label t from tokens before t: a row's first label has nothing before it."""
    labels = torch.tensor([[5, 6, IGNORE, 7], [8, IGNORE, IGNORE, IGNORE]])
    assert int(loss_tokens(labels)) == 2  # 6 and 7; the 5 and the 8 open their rows
