"""The allowed values of every choice key (``enum.StrEnum``), so a wrong choice fails at composition naming them.

The schema (``ddptrain/config/schema.py``) types its choice fields with these classes; Hydra then refuses any other
value with the list of allowed ones. ``resolve_precision`` resolves ``train.precision=auto`` for a device.
"""

from __future__ import annotations

from enum import StrEnum

ZERO_STAGES = (0, 1, 2, 3)  # parallel.zero_stage: DDP, then ZeRO-1, -2, -3


class Arch(StrEnum):
    llama = "llama"
    gpt2 = "gpt2"
    qwen3 = "qwen3"  # Llama's layout plus RMSNorm on queries and keys (QK-norm), head_dim of its own


class BaseDtype(StrEnum):
    """Dtype of the frozen base weights when fine-tuning (adapters always train in fp32)."""

    fp32 = "fp32"
    bf16 = "bf16"


class ActivationCheckpointing(StrEnum):
    """What each transformer block keeps for backward (``ddptrain/models/checkpointing.py``)."""

    none = "none"  # every activation autograd saves
    full = "full"  # only the block's input: the whole block runs again in backward
    selective = "selective"  # the matmul and attention outputs: the element-wise ops between them run again


class Quantize(StrEnum):
    """Quantization of the frozen base weights at load time (QLoRA: bitsandbytes NF4 under LoRA)."""

    none = "none"
    nf4 = "nf4"


class DataSource(StrEnum):
    stdlib_code = "stdlib_code"
    synthetic = "synthetic"
    files = "files"
    hub = "hub"
    instructions = "instructions"  # prompt/completion pairs generated locally (data.format=prompt_completion)


class DataFormat(StrEnum):
    """How records become training sequences."""

    packed = "packed"  # documents concatenated into full seq_len blocks; loss on every token
    prompt_completion = "prompt_completion"  # one padded sequence per record; loss on completion tokens only


class Engine(StrEnum):
    """torch DDP, or one of our from-scratch engines (``ddptrain/engines/``)."""

    torch = "torch"
    naive = "naive"
    overlap_sync = "overlap_sync"
    overlap_async = "overlap_async"
    bucketed = "bucketed"
    stream_bucketed = "stream_bucketed"


class Collective(StrEnum):
    native = "native"
    ring = "ring"


class Compression(StrEnum):
    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    powersgd = "powersgd"
    topk = "topk"


class ShardGroup(StrEnum):
    """Over which ranks ZeRO-2/3 shard model state: all of them, or each node's (HSDP: replicate across nodes)."""

    world = "world"
    node = "node"


class Kernels(StrEnum):
    """Who runs the element-wise passes around gradient collectives (pack, average, norm, clip, bf16 casts)."""

    auto = "auto"  # Triton on CUDA when it is importable, else torch
    triton = "triton"  # always Triton: a start-up error where it cannot run
    torch = "torch"  # always the torch ops


class Schedule(StrEnum):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


class OptimImpl(StrEnum):
    """AdamW's kernels: one fused kernel, one multi-tensor launch per op, or a Python loop over parameters."""

    auto = "auto"  # fused where torch has a fused AdamW for the device (CUDA, CPU), else foreach
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class Precision(StrEnum):
    auto = "auto"  # bf16 autocast on a GPU with bf16, fp16 (loss-scaled) on one without, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # fp16 autocast with a loss scaler: GPUs without bf16 (T4, V100)


class NanPolicy(StrEnum):
    skip = "skip"  # skip the update on every rank alike
    abort = "abort"  # stop the run (no checkpoint is written for the bad step)


class DriftPolicy(StrEnum):
    abort = "abort"  # stop the run on every rank, naming the ranks that differ (no checkpoint is written after)
    rebroadcast = "rebroadcast"  # copy the majority's parameters to the ranks that differ, warn, and go on
    off = "off"  # no fingerprint at the checks


class Backend(StrEnum):
    auto = "auto"  # nccl on CUDA, else gloo
    nccl = "nccl"
    gloo = "gloo"


class Launcher(StrEnum):
    torchrun = "torchrun"  # torch.distributed.run: launch.nproc_per_node workers here, or a Kubernetes pod's share
    ray = "ray"  # Ray Train's TorchTrainer on a Ray cluster: launch.ray_workers workers, one per rank


class DebugLevel(StrEnum):
    off = "off"
    info = "info"
    detail = "detail"


class Interconnect(StrEnum):
    nvlink = "nvlink"
    infiniband_ndr = "infiniband_ndr"
    pcie_gen5 = "pcie_gen5"


class Direction(StrEnum):
    """Whether a sweep's objective is better smaller or larger (``sweep.direction``)."""

    minimize = "minimize"
    maximize = "maximize"


def resolve_precision(precision: str, device_type: str, bf16_supported: bool) -> Precision:
    """``train.precision`` resolved for a device; the run (for its own device) and the planner (for
    ``plan.device``) both resolve it here, so a plan computes in what the run will. auto is bf16 on a GPU with
    bf16, fp16 with a loss scaler on one without (T4, V100: compute capability below 8) and fp32 on a CPU; an
    explicit choice stays."""
    if precision != Precision.auto:
        return Precision(precision)
    if device_type != "cuda":
        return Precision.fp32
    return Precision.bf16 if bf16_supported else Precision.fp16


class FtSync(StrEnum):
    """How replica groups of a fault-tolerant run (``ft.*``, torchft) agree: every step, or every ``ft.sync_every``
    inner steps through an outer optimizer (DiLoCo), or that with the model in fragments whose syncs overlap
    compute (Streaming DiLoCo)."""

    ddp = "ddp"
    diloco = "diloco"
    streaming_diloco = "streaming_diloco"
