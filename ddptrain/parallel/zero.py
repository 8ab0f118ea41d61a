"""ZeRO stages: 1 shards the optimizer state (ZeroRedundancyOptimizer over DDP); 2 and 3 use FSDP2.

Stage 2 keeps parameters whole from forward through backward (``reshard_after_forward=False``) and shards
gradients and optimizer state; stage 3 reshards parameters after every block's forward as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from ddptrain.config.choices import Precision, ShardGroup
from ddptrain.config.schema import ParallelConfig
from ddptrain.runtime.process_group import device_precision


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (the classes it lists in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_group_size(cfg: ParallelConfig, world_size: int, ranks_per_node: int) -> int:
    """How many ranks share one copy of the model state: the world, or one node's ranks under HSDP."""
    return ranks_per_node if cfg.shard_group == ShardGroup.node else world_size


def hybrid_mesh(device: torch.device, ranks_per_node: int, timeout: timedelta | None = None) -> DeviceMesh:
    """A 2-D mesh (nodes x ranks per node): FSDP2 shards along ``shard`` and all-reduces along ``replicate``.

    Ranks are numbered node by node (torchrun's rule), so each row of the mesh is one node's ranks and the
    frequent all-gathers and reduce-scatters stay on the fast intra-node links. The groups are built here with
    ``timeout`` (``dist.timeout_s``): ``init_device_mesh`` would give them torch's default (10 minutes on NCCL,
    30 on gloo), so a hang inside FSDP2's collectives would outlast the configured timeout by that much.
    """
    world = dist.get_world_size()
    layout = torch.arange(world).view(world // ranks_per_node, ranks_per_node)
    replicate, _ = dist.new_subgroups_by_enumeration(layout.T.tolist(), timeout=timeout, group_desc="mesh_replicate")
    shard, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout, group_desc="mesh_shard")
    return DeviceMesh.from_group([replicate, shard], device.type, mesh=layout, mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, cfg: ParallelConfig, device: torch.device, precision: str,
                ranks_per_node: int = 1, timeout: timedelta | None = None) -> FSDPModule:
    """FSDP2 ``fully_shard`` per transformer block, then the root (embeddings, head, final norm).

    With bf16 compute (``train.precision`` resolved for ``device``) parameters are gathered in bf16 and gradients
    reduced in fp32 over fp32 shards; with fp32 everything stays fp32, as under DDP. With
    ``parallel.shard_group=node`` the model state is sharded over each node's ranks and replicated across nodes
    (HSDP, its groups with ``timeout``); otherwise over every rank.
    """
    reshard = cfg.zero_stage == 3
    kwargs: dict = {"reshard_after_forward": reshard}
    if cfg.shard_group == ShardGroup.node:
        kwargs["mesh"] = hybrid_mesh(device, ranks_per_node, timeout)
    if device_precision(precision, device) == Precision.bf16:
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
