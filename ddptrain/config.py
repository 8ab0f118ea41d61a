"""Typed schema of every ddptrain config key: the single source of truth for names, types and defaults.

Hydra composes the YAML groups in ``configs/`` on top of these dataclasses, so an unknown key or a value
of the wrong type fails at start-up with a message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class ModelConfig:
    """A Hugging Face causal LM built from these numbers (or loaded from ``pretrained``)."""

    name: str = "llama_tiny"
    arch: str = "llama"  # llama | gpt2
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: as many as num_heads (no GQA)
    intermediate_size: int | None = None  # None: 4*hidden for gpt2, SwiGLU-sized for llama
    max_position_embeddings: int = 512
    vocab_size: int | None = None  # None: the tokenizer's vocabulary, rounded up to a multiple of 64
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    pretrained: str | None = None  # a local path or hub name; loads weights instead of building


@dataclass
class DataConfig:
    """Where tokens come from and how they are batched: gbs = mbs x grad_accum x dp."""

    source: str = "stdlib_code"  # stdlib_code | synthetic | files | hub
    paths: list[str] = field(default_factory=list)  # source=files: local .txt / .jsonl / .json / .parquet
    text_field: str = "text"
    name: str | None = None  # source=hub: a data set name
    subset: str | None = None
    split: str = "train"
    tokenizer: str | None = None  # a local tokenizer directory; None: train a byte-level BPE on the corpus
    vocab_size: int = 8192  # size of the BPE trained when tokenizer is None
    seq_len: int = 128
    global_batch_size: int = 32  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    grad_accum: int | None = None  # None: derived from the other two and the data-parallel size
    val_fraction: float = 0.02  # share of documents held out for validation
    max_documents: int | None = None  # cap on documents read (quick tests)
    num_samples: int = 8192  # source=synthetic: sequences in the data set
    cache_dir: str = "${oc.env:DDPTRAIN_CACHE_DIR,${oc.env:HOME,.}/.cache/ddptrain}"
    shuffle: bool = True
    num_workers: int = 0


class Kernels(StrEnum):
    """Who runs the element-wise passes around gradient collectives (pack, average, norm, clip, bf16 casts)."""

    auto = "auto"  # Triton on CUDA when it is importable, else torch
    triton = "triton"  # always Triton: a start-up error where it cannot run
    torch = "torch"  # always the torch ops


@dataclass
class ParallelConfig:
    """How gradients travel and where model state lives."""

    engine: str = "torch"  # torch | naive | overlap_sync | overlap_async | bucketed | stream_bucketed
    collective: str = "native"  # native | ring (from-scratch engines only)
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    compression: str = "none"  # none | fp16 | bf16 | powersgd | topk (DDP communication hooks)
    powersgd_rank: int = 4
    powersgd_start_iter: int = 10  # must be > 1 with error feedback (DDP rebuilds buckets after step 1)
    topk_ratio: float = 0.01  # share of each bucket's entries sent
    error_feedback: bool = True  # powersgd/topk: carry what was not sent into the next step
    zero_stage: int = 0  # 0 DDP | 1 sharded optimizer | 2 + sharded gradients | 3 + sharded parameters
    cpu_offload: bool = False  # zero_stage=3: keep parameters and optimizer state on the CPU
    kernels: Kernels = Kernels.auto  # fused Triton kernels for our engines, the clip step and the bf16 hook


@dataclass
class OptimConfig:
    """AdamW with warm-up and a cosine, WSD or constant schedule."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    grad_clip: float = 1.0  # global-norm clipping; 0 disables


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "ddptrain"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # online | offline | disabled; None: honour WANDB_MODE
    init_timeout_s: float = 60.0


@dataclass
class LoggerConfig:
    progress: bool = True  # a progress bar on rank 0 when stdout is a terminal
    jsonl: bool = True  # metrics.jsonl in the run directory
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic evaluation
    eval_batches: int = 8  # micro batches per rank per evaluation
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    resume: str | None = None  # auto (latest checkpoint in this run dir, if any) | a checkpoint or run dir | null
    nan_policy: str = "abort"  # non-finite loss or gradients: skip the update (every rank alike) | abort the run


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1  # >1 without torchrun: start the workers through torch's elastic launcher
    max_restarts: int = 0
    dry_run: bool = False  # print the plan (batch, memory, communication) and exit without training
    stop_grace_s: float = 25.0  # after SIGTERM, a rank that cannot reach a step boundary exits after this long


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_s: float = 300.0  # collective timeout
    debug: str = "off"  # off | info | detail (TORCH_DISTRIBUTED_DEBUG)


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0: only at the end of training (and when stopped by SIGTERM/SIGINT)
    keep_last: int = 2
    dir: str = "checkpoints"  # relative to the run directory
    export: bool = True  # at the end, save_pretrained the model (and tokenizer) to <run dir>/model


@dataclass
class PlanConfig:
    """Inputs of the planner that a real run does not need."""

    world_size: int | None = None  # None: the launch's world size
    params: float | None = None  # plan by parameter count alone (e.g. 70e9) instead of the model config
    interconnect: str = "nvlink"  # nvlink | infiniband_ndr | pcie_gen5
    bandwidth_gbps: float | None = None  # a measured bus bandwidth in GB/s; overrides the preset
    latency_us: float | None = None  # None: the preset's


@dataclass
class MetricsConfig:
    peak_tflops: float | None = None  # per-device peak for MFU; None: look the device up
    baseline: str | None = None  # single-rank tokens/s, or a run directory whose summary.json holds it
    sample_every: int = 1  # time the step breakdown every k steps


@dataclass
class ProfileConfig:
    """torch.profiler over a few steady steps: a Chrome trace and a PNG timeline of one step."""

    enabled: bool = False
    wait: int = 5  # steps skipped before the profiler starts (warm-up, bucket rebuild)
    warmup: int = 1
    active: int = 2  # steps recorded


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def job_config(cfg: DictConfig) -> DictConfig:
    """A composed config without Hydra's own ``hydra`` node: what the run itself is configured with."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    assert isinstance(job, DictConfig)
    return job


def build_config(*layers: DictConfig | dict[str, Any]) -> Config:
    """The schema's defaults with each layer merged on top, checked against the schema and typed."""
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), *layers))
    assert isinstance(typed, Config)
    return typed


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore; group files merge into its typed nodes and are checked there."""
    ConfigStore.instance().store(name="ddptrain_schema", node=Config)
