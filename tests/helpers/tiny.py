"""The tiny model most tests train: two layers of width 32, two heads (no GQA); vocabulary and positions as each
test needs them. One definition, so a test that shrinks or grows it says so with its own overrides."""

from __future__ import annotations

TINY_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2}  # keys of the model section
TINY_MODEL_ARGS = [f"model.{key}={value}" for key, value in TINY_MODEL.items()]  # the same, as CLI overrides

# A CLI run of a few seconds on the default data (1 layer, 2 steps, no evaluation, no export): what tests of the
# command itself (composition, config dirs, sweeps) train
TINY_RUN_ARGS = ["data.max_documents=40", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                 "model.num_layers=1", "model.hidden_size=64", "data.global_batch_size=2", "data.micro_batch_size=2",
                 "checkpoint.export=false", "logger.progress=false"]


def without(overrides: list[str], *keys: str) -> list[str]:
    """``overrides`` less those that set one of ``keys``."""
    return [o for o in overrides if o.split("=")[0] not in keys]
