"""The tiny model most tests train: two layers of width 32, two heads (no GQA); vocabulary and positions as each
test needs them. One definition, so a test that shrinks or grows it says so with its own overrides."""

from __future__ import annotations

TINY_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2}  # keys of the model section
TINY_MODEL_ARGS = [f"model.{key}={value}" for key, value in TINY_MODEL.items()]  # the same, as CLI overrides
