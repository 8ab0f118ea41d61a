"""A tiny "pretrained" model as users bring one (saved with ``save_pretrained``), and probes that show what ran
while it trained: checkpointed blocks, training mode, KV caches, saved activations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# Width 64 and MLP width 128: bitsandbytes' CPU 4-bit kernels pack weights in blocks of 64 inputs x 32 outputs.
TINY_LLAMA = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128}


def save_tiny_llama(out: Path, eos_id: int | None = None, **config: Any) -> Path:
    """A seeded tiny Llama saved with ``save_pretrained`` into ``out``; ``config`` overrides its shape/dropout."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY_LLAMA, **config}, bos_token_id=eos_id, eos_token_id=eos_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def count_checkpoint_calls(model: torch.nn.Module) -> list[int]:
    """Count the calls of every checkpointing block's checkpoint function from now on (a one-element list).

    transformers gives each ``GradientCheckpointingLayer`` the function it checkpoints with; a block calls it
    only while checkpointing is on and the block is in training mode.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    calls = [0]
    for block in model.modules():
        if isinstance(block, GradientCheckpointingLayer) and block.gradient_checkpointing:
            checkpoint = block._gradient_checkpointing_func

            def counted(*args: Any, _checkpoint: Callable = checkpoint, **kwargs: Any) -> Any:
                calls[0] += 1
                return _checkpoint(*args, **kwargs)

            block._gradient_checkpointing_func = counted
    return calls


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``step()`` runs its forward (then its backward)."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return saved[0]


def train_each_watched(rank: int, world_size: int, tmp: str, base: dict, variants: list[dict]) -> list[dict]:
    """``train_each`` through the real loop, each result with what ran: ``checkpoint_calls`` over the run,
    ``training`` (every module in training mode at every step's forward) and ``kv_caches`` built."""
    from transformers import DynamicCache

    import ddptrain.train.trainer as trainer
    from tests.helpers.trainers import train_each_with

    runs: list[dict[str, Any]] = []
    prepare = trainer.prepare_for_finetuning
    cache_init = DynamicCache.__init__

    def prepared(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = prepare(*args, **kwargs)
        runs.append({"checkpoint_calls": count_checkpoint_calls(model), "training": [], "kv_caches": 0})
        return model

    class Watched(trainer.Trainer):
        def forward_backward_step(self, step: int, micro_batches: Any) -> torch.Tensor:
            runs[-1]["training"].append(all(m.training for m in self.wrapped.outer.modules()))
            return super().forward_backward_step(step, micro_batches)

    def counted_cache(self: DynamicCache, *args: Any, **kwargs: Any) -> None:
        if runs:
            runs[-1]["kv_caches"] += 1
        cache_init(self, *args, **kwargs)

    trainer.prepare_for_finetuning = prepared  # type: ignore[assignment]  # this forked rank only
    DynamicCache.__init__ = counted_cache  # type: ignore[method-assign]
    results = train_each_with(Watched, rank, world_size, tmp, base, variants)
    for result, seen in zip(results, runs, strict=True):
        result.update(seen, checkpoint_calls=seen["checkpoint_calls"][0])
    return results
