"""Learning-rate schedules and weight-decay groups."""

from __future__ import annotations

import pytest
import torch

from ddptrain.config.schema import OptimConfig
from ddptrain.optim import lr_multiplier, param_groups


def test_warmup_then_cosine_to_the_floor() -> None:
    f = lr_multiplier(OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 110))


def test_wsd_holds_then_decays_linearly_over_the_last_fraction() -> None:
    f = lr_multiplier(OptimConfig(schedule="wsd", warmup_steps=0, decay_fraction=0.2, min_lr_ratio=0.0), steps=100)
    assert f(0) == f(79) == 1.0
    assert f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model.named_parameters(), 0.1)
    assert [p.ndim for p in decay["params"]] == [2] and len(no_decay["params"]) == 3
    assert no_decay["weight_decay"] == 0.0
