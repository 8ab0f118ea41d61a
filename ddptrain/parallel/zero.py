"""ZeRO stages: 1 shards the optimizer state (ZeroRedundancyOptimizer over DDP); 2 and 3 use FSDP2.

Stage 2 keeps parameters whole from forward through backward (``reshard_after_forward=False``) and shards
gradients and optimizer state; stage 3 reshards parameters after every block's forward as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ddptrain.config import ParallelConfig, computes_in_bf16

ZERO_STAGES = (0, 1, 2, 3)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (the classes it lists in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: torch.nn.Module, cfg: ParallelConfig, device: torch.device, precision: str) -> FSDPModule:
    """FSDP2 ``fully_shard`` per transformer block, then the root (embeddings, head, final norm).

    With bf16 compute (``train.precision`` resolved for ``device``) parameters are gathered in bf16 and gradients
    reduced in fp32 over fp32 shards; with fp32 everything stays fp32, as under DDP.
    """
    reshard = cfg.zero_stage == 3
    kwargs: dict = {"reshard_after_forward": reshard}
    if computes_in_bf16(precision, device.type):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


@contextmanager
def fsdp_sync(model: FSDPModule, sync: bool) -> Iterator[None]:
    """Skip FSDP2's reduce-scatter on accumulation micro-steps (its counterpart of DDP's ``no_sync``)."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
