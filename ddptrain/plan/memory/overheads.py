"""What a rank's GPU holds beyond the traced step that depends on how the run is set up: NCCL's communicators
(counted by the process groups the run makes), NVLink SHARP's buffers, and the caching allocator's fragmentation.
Each figure is an assumption sized from public reports, named here and in docs/memory_plan.md; none is measured
here (no GPU is lent to this project).

Communicators per rank, from the groups ddptrain makes (``runtime/process_group.py``, ``parallel/zero.py``):
the default group is the only NCCL group of DDP, ZeRO-1 and ZeRO-2/3 over every rank (FSDP2's 1-D mesh reuses
it); ZeRO-2/3 with ``parallel.shard_group=node`` (HSDP) adds the 2-D mesh's shard and replicate groups, each a
communicator of its own (``ncclCommSplit`` without shared resources), so three. The asynchronous checkpoint's
group is gloo, on the host, and costs no GPU memory; CPU offload's collectives on CPU tensors run on gloo too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddptrain.config.choices import DataFormat, ShardGroup
from ddptrain.config.schema import Config
from ddptrain.runtime.allocator import expandable_segments

GiB = 1024**3

# NVIDIA/nccl#864: one communicator that has run an all-reduce held about 1.6 GB of GPU memory, three or more
# about 6 GB; fitted as 1.6 GB for the first and 2.2 GB for each further one (the NCCL maintainers' answer there:
# memory grows with the channels NCCL opens for the link's bandwidth and with each communicator, unless split
# with shared resources). NVIDIA/nccl#964 measured 0.5-0.7 GB per group on 4 x A100: on smaller links these are
# over-counts, which cost batch, never an out-of-memory error.
NCCL_FIRST_COMMUNICATOR = 1.6e9
NCCL_FURTHER_COMMUNICATOR = 2.2e9
# NVLink SHARP (NVLS), which NCCL uses on NVSwitch systems (H100/H200 SXM and newer) for groups of more than two
# GPUs of a node: NCCL's own log on 8 x H200 reports 288 MiB of NVLS buffers per rank (vllm-project/vllm#9699),
# and containers turn it off (NCCL_NVLS_ENABLE=0) because its set-up binds much more (NVIDIA/JAX-Toolbox#383,
# NVIDIA/NeMo-Framework-Launcher#127); assumed 1 GiB per such group.
NVLS_PER_GROUP = 1.0 * GiB
# The caching allocator's fragmentation and cache, as a share of the traced peak: 10% where shapes repeat or
# expandable segments are on (ddptrain's default), 20% where micro batches change shape and they are off.
FRAGMENTATION = 0.10
FRAGMENTATION_VARYING_SHAPES = 0.20


@dataclass(frozen=True)
class RunOverheads:
    """The settings of a run that decide its device overheads beyond the trace."""

    ranks_per_node: int  # GPUs of one node in the run (NVLS needs more than 2 in a group)
    hsdp: bool  # parallel.shard_group=node: FSDP2 on a 2-D mesh at ZeRO-2/3
    varying_shapes: bool  # micro batches change shape (prompt/completion: padded to the longest, or packed rows)
    expandable_segments: bool  # the allocator's settings as the run will have them
    nvls: bool = True  # NCCL may use NVLS (NCCL_NVLS_ENABLE is not 0)

    @classmethod
    def of(cls, cfg: Config, ranks_per_node: int, environ: Mapping[str, str]) -> RunOverheads:
        return cls(ranks_per_node, cfg.parallel.shard_group == ShardGroup.node,
                   cfg.data.format == DataFormat.prompt_completion, expandable_segments(environ),
                   environ.get("NCCL_NVLS_ENABLE", "").strip() != "0")

    def communicators(self, stage: int, world_size: int) -> int:
        """NCCL communicators this rank is a member of."""
        if world_size <= 1:
            return 0
        return 3 if self.hsdp and stage >= 2 else 1

    def nvls_groups(self, stage: int, world_size: int) -> int:
        """Communicators over more than two GPUs of one node: the default group, and HSDP's shard group (one
        node's ranks); HSDP's replicate group holds one rank per node."""
        if not self.nvls or world_size <= 1 or min(self.ranks_per_node, world_size) <= 2:
            return 0
        return 2 if self.hsdp and stage >= 2 else 1

    def items(self, stage: int, world_size: int, nvlink_sharp: bool) -> dict[str, float]:
        """The NCCL allowance lines for a CUDA device (``nvlink_sharp``: it is an NVSwitch-class GPU)."""
        items: dict[str, float] = {}
        if (n := self.communicators(stage, world_size)) > 0:
            groups = "the default group" if n == 1 else "the default group and HSDP's shard and replicate groups"
            items[f"NCCL: {n} communicator{'s' if n > 1 else ''} ({groups}; 1.6 GB for one, 2.2 GB for each more, "
                  "as reported in NVIDIA/nccl#864)"] = (NCCL_FIRST_COMMUNICATOR
                                                        + (n - 1) * NCCL_FURTHER_COMMUNICATOR)
        if nvlink_sharp and (k := self.nvls_groups(stage, world_size)) > 0:
            items[f"NVLink SHARP buffers: {k} group{'s' if k > 1 else ''} of more than 2 GPUs on a node (assumed "
                  "1 GiB each; NCCL_NVLS_ENABLE=0 frees it)"] = k * NVLS_PER_GROUP
        return items

    def fragmentation(self) -> tuple[float, str]:
        """The share of the peak counted for fragmentation and cache, and why."""
        if self.varying_shapes and not self.expandable_segments:
            return FRAGMENTATION_VARYING_SHAPES, ("micro batches change shape and expandable segments are off "
                                                  "in PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF")
        if self.varying_shapes:
            return FRAGMENTATION, "expandable segments on"
        return FRAGMENTATION, "micro batches of one shape"


def ranks_per_node(cfg: Config, world_size: int) -> int:
    """GPUs per node of a planned run: ``plan.world_size`` (else ``world_size``) over ``plan.nodes``."""
    return max(1, (cfg.plan.world_size or world_size) // max(cfg.plan.nodes, 1))
