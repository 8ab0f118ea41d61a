"""Activation checkpointing of each transformer block: none, full or selective (``model.activation_checkpointing``).

Full checkpointing keeps only a block's input and runs the whole block again in backward. Selective
checkpointing is torchtitan's per-op policy: inside each block the outputs of the matmuls and of attention are
kept (the expensive ops), and the cheap element-wise ops between them (norms, activations, residual adds, casts,
rotary embeddings) run again in backward. It keeps less than no checkpointing (the element-wise ops' inputs and
intermediates are gone) and recomputes no FLOP-heavy op.

Both go through transformers' own mechanism (``activation_checkpointing_enable`` and peft's
``prepare_model_for_kbit_training`` pass their kwargs to ``torch.utils.checkpoint.checkpoint``), non-reentrant,
with a ``context_fn`` from ``create_selective_checkpoint_contexts`` for the selective policy: each block's
``forward`` is checkpointed, so FSDP2's and DDP's hooks stay outside it and ``torch.compile`` traces it.
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ddptrain.config.choices import ActivationCheckpointing
from ddptrain.config.schema import ModelConfig

# Ops whose outputs selective checkpointing keeps, by name (every overload): matmuls (nn.Linear dispatches to mm
# or addmm, GPT-2's Conv1D to addmm, eager attention to bmm/baddbmm, a 4-bit base on the CPU to bitsandbytes'
# gemm_4bit; on a GPU bitsandbytes unpacks the weight and calls mm) and attention kernels (SDPA's flash,
# memory-efficient, cuDNN and CPU kernels; FlashAttention-2's own ops when it is installed).
SAVED_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "bitsandbytes::gemm_4bit",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable", "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward",
})


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep what ``SAVED_OPS`` names, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Any:
    """A fresh pair of contexts per checkpointed call (forward caches the kept outputs, recompute replays them)."""
    return create_selective_checkpoint_contexts(save_matmuls)


def checkpoint_kwargs(cfg: ModelConfig) -> dict[str, Any] | None:
    """What ``torch.utils.checkpoint.checkpoint`` gets for each block; None without checkpointing."""
    mode = cfg.activation_checkpointing
    if mode == ActivationCheckpointing.none:
        return None
    if mode == ActivationCheckpointing.selective:
        return {"use_reentrant": False, "context_fn": selective_contexts}
    return {"use_reentrant": cfg.checkpoint_reentrant}


def deprecation_line(cfg: ModelConfig) -> str | None:
    """The one start-up line for the deprecated ``model.gradient_checkpointing`` (None when it is not set)."""
    if cfg.gradient_checkpointing is None:
        return None
    return (f"model.gradient_checkpointing={str(cfg.gradient_checkpointing).lower()} is deprecated: it means "
            f"model.activation_checkpointing={cfg.activation_checkpointing}; set that key instead")
