"""Model presets built from config, and their parameter and FLOP counts."""

from ddptrain.models.build import build_model, model_vocab_size

__all__ = ["build_model", "model_vocab_size"]
