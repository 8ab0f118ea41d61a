"""Other libraries' noise kept out of the user's console: what transformers, Optuna and the stop notice printed
around ddptrain's own lines (issue 50). The checkpoint tool's: tests/test_checkpoint_safety.py."""

from __future__ import annotations

import logging

import pytest
import torch

from ddptrain.config.schema import ModelConfig
from ddptrain.models import build_model
from ddptrain.plan.memory.trace import pretrained_shape


@pytest.mark.parametrize("build", [build_model, pretrained_shape])
def test_a_gpt2_loss_does_not_warn_that_its_loss_type_is_unrecognized(build: object) -> None:
    """transformers finds a loss by the model's class name, and GPT2LMHeadModel names none: its first loss warned
    "`loss_type=None` was set in the config but it is unrecognized" (the dry run's first console line). The loss is
    still transformers' causal-LM loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.utils import logging as hf_logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library = logging.getLogger("transformers")
    verbosity = hf_logging.get_verbosity()
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  # transformers' once-per-process cache
    hf_logging.set_verbosity_warning()
    library.addHandler(handler)
    try:
        cfg = ModelConfig(arch="gpt2", hidden_size=32, num_layers=1, num_heads=2)  # type: ignore[arg-type]
        model = build(cfg, 64)  # type: ignore[operator]
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
    finally:
        library.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [r.getMessage() for r in records if "loss_type" in r.getMessage()] == []
    assert model.loss_function is ForCausalLMLoss
    assert torch.isfinite(loss)
