"""Typed schema of every ddptrain config key: the single source of truth for names, types and defaults.

Hydra composes the YAML groups in ``configs/`` on top of these dataclasses, so an unknown key, a value of the
wrong type or a choice that does not exist (choice fields are typed with the StrEnums of ``ddptrain/config/choices.py``)
fails at composition with a message that names the key (and the allowed values). Checks that need only the
config run in ``__post_init__``, once each; checks that need the world size, devices or data live where those
are known (``ddptrain/app/preflight.py`` and the packages). ``ddptrain/config/compose.py`` builds a ``Config``
from YAML layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddptrain.config.choices import (
    ZERO_STAGES,
    ActivationCheckpointing,
    Arch,
    Backend,
    BaseDtype,
    Collective,
    Compression,
    DataFormat,
    DataSource,
    DebugLevel,
    Direction,
    DriftPolicy,
    Engine,
    FtSync,
    Interconnect,
    Kernels,
    Launcher,
    NanPolicy,
    OptimImpl,
    Precision,
    Quantize,
    Schedule,
    ShardGroup,
    WandbMode,
)
from ddptrain.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(section: str, obj: object, *keys: str) -> None:
    for key in keys:
        _require(getattr(obj, key) >= 1, f"{section}.{key}={getattr(obj, key)}: expected a positive integer")


@dataclass
class LoraSettings:
    """LoRA adapters through peft: only these train; the base model stays frozen and is never all-reduced."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # module names, or all-linear

    def __post_init__(self) -> None:
        _require(self.r >= 1, f"model.lora.r={self.r}: expected a positive rank")
        _require(self.alpha > 0, f"model.lora.alpha={self.alpha}: expected a positive scale")
        _require(0.0 <= self.dropout < 1.0, f"model.lora.dropout={self.dropout}: expected a probability in [0, 1)")
        _require(bool(self.target_modules), "model.lora.target_modules: expected module names or [all-linear]")


@dataclass
class ModelConfig:
    """A Hugging Face causal LM built from these numbers (or loaded from ``pretrained``)."""

    name: str = "llama_tiny"
    arch: Arch = Arch.llama
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: as many as num_heads (no GQA)
    head_dim: int | None = None  # llama/qwen3: width of one attention head; None: hidden_size / num_heads
    intermediate_size: int | None = None  # None: 4*hidden for gpt2, SwiGLU-sized for llama
    max_position_embeddings: int = 512
    vocab_size: int | None = None  # None: the tokenizer's vocabulary, rounded up to a multiple of 64
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    pretrained: str | None = None  # a local path or hub name; loads weights instead of building
    dtype: BaseDtype = BaseDtype.fp32  # pretrained: dtype of the loaded base weights
    device_map: str = "rank"  # rank: the whole model on this rank's device (the only layout data parallelism allows)
    quantize: Quantize = Quantize.none  # nf4: 4-bit base weights (needs model.lora.enabled=true)
    # none | full: recompute each block in backward | selective: keep matmul/attention outputs, recompute the rest
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    gradient_checkpointing: bool | None = None  # deprecated: true = activation_checkpointing=full, false = none
    checkpoint_reentrant: bool = False  # full checkpointing, torch's reentrant variant; a failed backward says so
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        self._resolve_checkpointing()
        if self.pretrained is not None:
            return  # the loaded model's own config decides
        _positive("model", self, "hidden_size", "num_layers", "num_heads", "max_position_embeddings")
        _require(self.hidden_size % self.num_heads == 0,
                 f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        kv = self.num_kv_heads or self.num_heads
        _require(self.num_heads % kv == 0,
                 f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={kv}")
        _require(self.arch != Arch.gpt2 or kv == self.num_heads,
                 f"model.num_kv_heads={kv}: gpt2 has no grouped-query attention; use {self.num_heads}")
        _require(self.head_dim is None or (self.head_dim >= 1 and self.arch != Arch.gpt2),
                 f"model.head_dim={self.head_dim}: expected a positive width for llama or qwen3 (gpt2: null)")

    def _resolve_checkpointing(self) -> None:
        """The deprecated ``gradient_checkpointing`` sets ``activation_checkpointing`` (true: full, false: none) unless
        that says otherwise; ``checkpoint_reentrant`` is full checkpointing's variant."""
        mode = ActivationCheckpointing(self.activation_checkpointing)
        if self.gradient_checkpointing is not None:
            old = ActivationCheckpointing.full if self.gradient_checkpointing else ActivationCheckpointing.none
            _require(mode in (old, ActivationCheckpointing.none),
                     f"model.gradient_checkpointing={str(self.gradient_checkpointing).lower()} contradicts "
                     f"model.activation_checkpointing={mode}: set only model.activation_checkpointing")
            mode = old
        self.activation_checkpointing = mode
        _require(not self.checkpoint_reentrant or mode == ActivationCheckpointing.full,
                 f"model.checkpoint_reentrant=true needs model.activation_checkpointing=full (it is {mode}): "
                 "the reentrant variant recomputes whole blocks only")


AUTO = "auto"  # data.micro_batch_size=auto: chosen at start-up from the traced memory plan
AUTO_NEEDS_MEMORY = ("data.micro_batch_size=auto needs the device's memory: set plan.device_memory_gib (GiB per "
                     "rank; a CPU has no memory of its own to plan for)")


@dataclass
class DataConfig:
    """Where tokens come from and how they are batched: gbs = mbs x grad_accum x dp."""

    source: DataSource = DataSource.stdlib_code
    paths: list[str] = field(default_factory=list)  # source=files: local .txt / .jsonl / .json / .parquet
    text_field: str = "text"
    format: DataFormat = DataFormat.packed
    prompt_field: str = "prompt"  # format=prompt_completion: the record fields holding the two parts
    completion_field: str = "completion"
    chat_template: bool = True  # format=prompt_completion: wrap the prompt in the tokenizer's chat template if any
    # format=prompt_completion: pack each micro batch's examples into rows of <= seq_len tokens (position_ids
    # restarting per example, no padding between them); false: pad each example to the micro batch's longest
    packing: bool = True
    name: str | None = None  # source=hub: a data set name
    subset: str | None = None
    split: str = "train"
    tokenizer: str | None = None  # a local tokenizer directory; None: train a byte-level BPE on the corpus
    vocab_size: int = 8192  # size of the BPE trained when tokenizer is None
    seq_len: int = 128
    global_batch_size: int = 32  # sequences per optimizer step, over all ranks
    # sequences per forward/backward on one rank; auto: the largest whose traced step fits the device (at start-up)
    micro_batch_size: int | str = 8
    grad_accum: int | None = None  # None: derived from the other two and the data-parallel size
    val_fraction: float = 0.02  # share of documents held out for validation
    max_documents: int | None = None  # cap on documents read (quick tests)
    num_samples: int = 8192  # source=synthetic: sequences in the data set
    cache_dir: str = "${oc.env:DDPTRAIN_CACHE_DIR,${oc.env:HOME,.}/.cache/ddptrain}"
    shuffle: bool = True
    num_workers: int = 0
    prepare_timeout_s: float = 3600.0  # how long other ranks (and other jobs) wait for the data to be prepared
    num_proc: int | None = None  # worker processes tokenizing the corpus; None: the cores available
    shard_tokens: int = 1 << 27  # tokens per shard file of the prepared cache (256 MiB at uint16)
    streaming: bool = False  # tokenize on the fly while training (files/hub): nothing prepared, resumes on the same dp
    tokenizer_sample_mb: float = 64.0  # text the BPE trains on (the first MB of training documents) when tokenizer=None

    def __post_init__(self) -> None:
        _require(self.global_batch_size >= 1,
                 f"data.global_batch_size={self.global_batch_size}: expected a positive number of sequences")
        mbs = self.micro_batch_size
        _require(mbs == AUTO or (type(mbs) is int and mbs >= 1),
                 f"data.micro_batch_size={mbs!r}: expected a positive number of sequences or {AUTO}")
        _require(mbs != AUTO or self.grad_accum is None,
                 f"data.grad_accum={self.grad_accum}: expected null with data.micro_batch_size=auto (it is derived "
                 "from the micro batch chosen)")
        _require(self.seq_len >= 2, f"data.seq_len={self.seq_len}: expected at least 2 tokens")
        _require(self.grad_accum is None or self.grad_accum >= 1,
                 f"data.grad_accum={self.grad_accum}: expected a positive number of micro-steps (or null)")
        _require(0.0 < self.val_fraction < 0.5, f"data.val_fraction={self.val_fraction}: expected a share in (0, 0.5)")
        _require(self.source != DataSource.files or bool(self.paths),
                 "data.paths: expected at least one local file for data.source=files")
        _require(self.source != DataSource.hub or bool(self.name),
                 "data.name: expected a hub data set name for data.source=hub")
        _require(self.prepare_timeout_s > 0,
                 f"data.prepare_timeout_s={self.prepare_timeout_s}: expected a positive number of seconds")
        _require(self.num_proc is None or self.num_proc >= 1,
                 f"data.num_proc={self.num_proc}: expected a positive number of processes (or null: every core)")
        _require(not self.streaming or (self.source in (DataSource.files, DataSource.hub)
                                        and self.format == DataFormat.packed and self.tokenizer is not None),
                 "data.streaming=true: expected data.source=files or hub, data.format=packed and a data.tokenizer "
                 "(a BPE trained here would need a pass over the data first)")
        _require(self.shard_tokens >= 1, f"data.shard_tokens={self.shard_tokens}: expected a positive number of tokens")
        _require(self.tokenizer_sample_mb > 0,
                 f"data.tokenizer_sample_mb={self.tokenizer_sample_mb}: expected a positive size in MB")


@dataclass
class ParallelConfig:
    """How gradients travel and where model state lives."""

    engine: Engine = Engine.torch
    collective: Collective = Collective.native  # ring: our ring all-reduce (from-scratch engines only)
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    compression: Compression = Compression.none  # DDP communication hooks
    powersgd_rank: int = 4
    powersgd_start_iter: int = 10  # must be > 1 with error feedback (DDP rebuilds buckets after step 1)
    topk_ratio: float = 0.01  # share of each bucket's entries sent
    error_feedback: bool = True  # powersgd/topk: carry what was not sent into the next step
    zero_stage: int = 0  # 0 DDP | 1 sharded optimizer | 2 + sharded gradients | 3 + sharded parameters
    cpu_offload: bool = False  # zero_stage=3: keep parameters and optimizer state on the CPU
    shard_group: ShardGroup = ShardGroup.world  # zero_stage 2-3: node = shard within a node, replicate across
    kernels: Kernels = Kernels.auto  # fused Triton kernels for our engines, the clip step and the bf16 hook
    wrap_single: bool = False  # world size 1: wrap anyway (to measure the wrapper's overhead); default: bare model

    def __post_init__(self) -> None:
        _require(self.bucket_cap_mb > 0, f"parallel.bucket_cap_mb={self.bucket_cap_mb}: expected a positive size in MB")
        _require(self.zero_stage in ZERO_STAGES, f"parallel.zero_stage={self.zero_stage}: expected 0, 1, 2 or 3")
        if self.compression == Compression.powersgd:
            _require(self.powersgd_rank >= 1, f"parallel.powersgd_rank={self.powersgd_rank}: must be >= 1")
            _require(self.powersgd_start_iter > 1,
                     f"parallel.powersgd_start_iter={self.powersgd_start_iter}: must be > 1 (DDP rebuilds its buckets "
                     "after the first step, and PowerSGD's warm start and error feedback keep per-bucket state)")
        _require(self.compression != Compression.topk or 0 < self.topk_ratio <= 1,
                 f"parallel.topk_ratio={self.topk_ratio}: must be in (0, 1]")
        _require(self.compression == Compression.none or self.zero_stage < 2,
                 f"parallel.compression={self.compression} cannot be combined with parallel.zero_stage="
                 f"{self.zero_stage}: compression hooks belong to DDP, and stages 2-3 reduce-scatter through FSDP2")
        _require(self.shard_group == ShardGroup.world or self.zero_stage >= 2,
                 f"parallel.shard_group={self.shard_group} needs parallel.zero_stage=2 or 3 (got {self.zero_stage}): "
                 "only FSDP2 shards model state over a group")
        _require(not self.cpu_offload or self.zero_stage == 3,
                 f"parallel.cpu_offload=true needs parallel.zero_stage=3 (got {self.zero_stage})")
        if self.engine == Engine.torch:
            _require(self.collective == Collective.native, f"parallel.collective={self.collective} needs a "
                     "from-scratch parallel.engine (torch DDP uses native)")
            return
        for key, value, default in (("zero_stage", self.zero_stage, 0), ("compression", self.compression, "none")):
            _require(value == default, f"parallel.engine={self.engine} cannot be combined with parallel.{key}={value}: "
                     "ZeRO and compression hooks run on torch DDP (parallel.engine=torch)")


@dataclass
class OptimConfig:
    """AdamW with warm-up and a cosine, WSD or constant schedule."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    impl: OptimImpl = OptimImpl.auto  # fused skips a non-finite step on the device, with no host read

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr={self.lr}: expected a positive learning rate")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"optim.betas={list(self.betas)}: expected two numbers in [0, 1)")
        _require(self.warmup_steps >= 0 and self.grad_clip >= 0 and self.weight_decay >= 0,
                 "optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1 and 0 <= self.decay_fraction <= 1,
                 "optim.min_lr_ratio and optim.decay_fraction must be in [0, 1]")


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "ddptrain"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: WandbMode | None = None  # None: honour WANDB_MODE
    group: str | None = None  # W&B run group (a multirun sets it to the sweep's name)
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
    precision: Precision = Precision.auto
    resume: str | None = None  # auto (latest checkpoint in this run dir, if any) | a checkpoint or run dir | null
    nan_policy: NanPolicy = NanPolicy.abort  # on a non-finite loss or gradient
    check_every: int = 10  # steps between the ranks' agreement on stop requests and non-finite steps (a sync)
    # when data-parallel replicas' parameters differ at a check (each rank's fingerprint rides on its agreement)
    drift_policy: DriftPolicy = DriftPolicy.abort
    compile: bool = False  # torch.compile each transformer block (torch DDP and the ZeRO stages)
    # LM head + cross-entropy chunk by chunk over the tokens: the [tokens, vocab] logits never exist whole; on for
    # the heads where it is exact (Llama, Mistral, Qwen2/3, GPT-2; a plain linear head), else the full logits
    chunked_loss: bool = True
    # tokens per chunk; null: one fp32 [chunk, vocab] block <= 64 MiB, on CUDA at least 1024 (256: a frozen head)
    loss_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "log_every", "eval_batches", "check_every")
        _require(self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1,
                 f"train.loss_chunk_tokens={self.loss_chunk_tokens}: expected a positive number of tokens per "
                 "chunk (null: chosen from the vocabulary)")
        _require(self.eval_every >= 0, f"train.eval_every={self.eval_every}: expected >= 0 (0 disables evaluation)")


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1  # >1 without torchrun: start the workers through torch's elastic launcher
    max_restarts: int = 0
    dry_run: bool = False  # print the plan (batch, memory, communication) and exit without training
    stop_grace_s: float = 25.0  # after SIGTERM, a rank that cannot reach the next check step exits after this long
    backend: Launcher = Launcher.torchrun  # ray: Ray Train's TorchTrainer (the extra ddptrain[ray])
    ray_address: str | None = None  # a Ray cluster's address; None: $RAY_ADDRESS, else a Ray instance started here
    ray_workers: int | None = None  # Ray workers, one per rank, over the cluster; None: launch.nproc_per_node
    ray_use_gpu: bool | None = None  # one GPU per Ray worker; None: when the cluster has GPUs

    def __post_init__(self) -> None:
        _require(self.nproc_per_node >= 1 and self.max_restarts >= 0,
                 "launch.nproc_per_node must be >= 1 and launch.max_restarts >= 0")
        _require(self.ray_workers is None or self.ray_workers >= 1,
                 f"launch.ray_workers={self.ray_workers}: expected a positive number of workers (or null)")
        _require(self.stop_grace_s > 0,
                 f"launch.stop_grace_s={self.stop_grace_s}: expected a positive number of seconds")


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    timeout_s: float = 300.0  # collective timeout
    debug: DebugLevel = DebugLevel.off  # TORCH_DISTRIBUTED_DEBUG: info or detail checks collectives
    # entries in torch's flight-recorder ring, one per process for every group, read to name a hang: null keeps
    # torch's (TORCH_FR_BUFFER_SIZE, else 2000); a number sets it (below 2000 it can lose a waiter's collective);
    # 0 turns the recorder and NCCL's dump off
    flight_recorder: int | None = None

    def __post_init__(self) -> None:
        _require(self.timeout_s > 0, f"dist.timeout_s={self.timeout_s}: expected a positive number of seconds")
        _require(self.flight_recorder is None or self.flight_recorder >= 0,
                 f"dist.flight_recorder={self.flight_recorder}: expected a number of entries >= 0 (0: off; null: "
                 "torch's own ring)")


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0: only at the end of training (and when stopped by SIGTERM/SIGINT)
    keep_last: int = 2
    dir: str = "checkpoints"  # relative to the run directory
    export: bool = True  # at the end, save_pretrained the model (and tokenizer) to <run dir>/model
    async_save: bool = False  # copy state to host memory and write it in the background (at most one in flight)
    export_timeout_s: float = 3600.0  # how long other ranks wait for rank 0 to export (merge, save) the model
    overwrite: bool = False  # let a fresh run replace the committed checkpoints already in its run dir

    def __post_init__(self) -> None:
        _require(self.every_n_steps >= 0 and self.keep_last >= 1,
                 "checkpoint.every_n_steps must be >= 0 and checkpoint.keep_last >= 1")
        _require(self.export_timeout_s > 0,
                 f"checkpoint.export_timeout_s={self.export_timeout_s}: expected a positive number of seconds")


@dataclass
class PlanConfig:
    """Inputs of the planner that a real run does not need."""

    world_size: int | None = None  # None: the launch's world size
    device: str | None = None  # the device the plan is for: h100, a100, l4, t4, ... or cpu; None: this machine's
    device_memory_gib: float | None = None  # None: the device's own memory
    params: float | None = None  # plan by parameter count alone (e.g. 70e9) instead of the model config
    trainable_params: float | None = None  # with plan.params and model.lora.enabled: the adapter parameters
    interconnect: Interconnect = Interconnect.nvlink
    bandwidth_gbps: float | None = None  # a measured bus bandwidth in GB/s; overrides the preset
    latency_us: float | None = None  # None: the preset's
    from_run: str | None = None  # a finished run dir: predict its step at plan.world_size on plan.nodes nodes
    nodes: int = 1  # nodes the plan.world_size ranks are spread over (equal ranks per node)
    inter_node: Interconnect = Interconnect.infiniband_ndr  # the link between nodes; plan.interconnect: within one
    hierarchical: bool = True  # multi-node all-reduce: within nodes, then across (false: one flat ring)

    def __post_init__(self) -> None:
        _require(self.device_memory_gib is None or self.device_memory_gib > 0,
                 f"plan.device_memory_gib={self.device_memory_gib}: expected a positive number of GiB per device "
                 "(or null: the device's own)")


@dataclass
class MetricsConfig:
    peak_tflops: float | None = None  # per-device peak for MFU; None: look the device up
    baseline: str | None = None  # single-rank tokens/s, or a run directory whose summary.json holds it
    sample_every: int | None = None  # time the step breakdown every k steps; None: 1 on CPU, 10 on CUDA (syncs)
    straggler_windows: int = 5  # a rank slowest in most of the last K logged windows is a persistent straggler
    straggler_pct: float = 20.0  # ... when it is busy this many percent longer than the median rank

    def __post_init__(self) -> None:
        _require(self.sample_every is None or self.sample_every >= 1,
                 f"metrics.sample_every={self.sample_every}: expected a positive integer (or null)")
        _require(self.straggler_windows >= 1 and self.straggler_pct >= 0,
                 f"metrics.straggler_windows={self.straggler_windows}, metrics.straggler_pct={self.straggler_pct}: "
                 "expected >= 1 window and a threshold >= 0 percent")


@dataclass
class ProfileConfig:
    """torch.profiler over a few steady steps: a Chrome trace and a PNG timeline of one step."""

    enabled: bool = False
    wait: int = 5  # steps skipped before the profiler starts (warm-up, bucket rebuild)
    warmup: int = 1
    active: int = 2  # steps recorded

    def __post_init__(self) -> None:
        _require(not self.enabled or (self.wait >= 0 and self.warmup >= 0 and self.active >= 1),
                 "profile.wait and profile.warmup must be >= 0 and profile.active >= 1")


# summary.json figures a sweep job can return to its sweeper (each a number, or null when the run did not reach it)
OBJECTIVES = ("final_val_loss", "final_loss", "tokens_per_s", "mfu_pct", "step_time_s", "time_exposed_comm_s",
              "overlap_pct", "max_allocated_gib", "rss_gib")


@dataclass
class SweepConfig:
    """``ddptrain -m``: what each job returns to the sweeper (Optuna, Nevergrad, Ax search on it)."""

    objective: str = "final_val_loss"  # a summary.json figure
    direction: Direction = Direction.minimize  # must agree with a searching sweeper's own hydra.sweeper.direction

    def __post_init__(self) -> None:
        _require(self.objective in OBJECTIVES,
                 f"sweep.objective={self.objective!r}: expected one of {', '.join(OBJECTIVES)}")


@dataclass
class FtConfig:
    """Fault-tolerant data parallelism through torchft (the extra ddptrain[ft]): ``replica_groups`` groups of
    ``launch.nproc_per_node`` workers each train as one data-parallel run; a group that fails is restarted alone and
    heals its state live from a peer while the others keep stepping (docs/reliability.md)."""

    replica_groups: int = 0  # R groups; 0: off (a failure anywhere restarts every rank, as torchrun does)
    replica_id: int | None = None  # this process's group, 0..R-1: set by the launcher or the manifest, not by hand
    lighthouse: str | None = None  # the torchft lighthouse's address (http://host:port); null: one started here
    min_replicas: int = 1  # groups a step needs; fewer: the survivors wait, then stop cleanly with a checkpoint
    sync: FtSync = FtSync.ddp  # ddp: every step; diloco / streaming_diloco: every sync_every inner steps
    sync_every: int = 8  # H: inner steps between outer syncs (diloco, streaming_diloco)
    fragments: int = 1  # streaming_diloco: the model's fragments, each synced at its own offset in the window
    outer_lr: float = 0.7  # the outer optimizer: SGD with Nesterov momentum on the pseudo-gradients
    outer_momentum: float = 0.9
    group_restarts: int = 3  # restarts of one group by its own agent before the run gives it up
    quorum_timeout_s: float = 60.0  # how long a step waits for the lighthouse's quorum

    def __post_init__(self) -> None:
        _require(self.replica_groups >= 0,
                 f"ft.replica_groups={self.replica_groups}: expected a number of groups >= 0 (0: off)")
        _require(self.replica_id is None or 0 <= self.replica_id < max(self.replica_groups, 1),
                 f"ft.replica_id={self.replica_id}: expected a group between 0 and ft.replica_groups - 1 "
                 f"({self.replica_groups - 1})")
        _require(1 <= self.min_replicas <= max(self.replica_groups, 1),
                 f"ft.min_replicas={self.min_replicas}: expected 1 to ft.replica_groups ({self.replica_groups})")
        for key in ("sync_every", "fragments"):
            _require(getattr(self, key) >= 1, f"ft.{key}={getattr(self, key)}: expected a positive integer")
        _require(self.outer_lr > 0, f"ft.outer_lr={self.outer_lr}: expected a positive learning rate")
        _require(0 <= self.outer_momentum < 1, f"ft.outer_momentum={self.outer_momentum}: expected 0 <= m < 1")
        _require(self.group_restarts >= 0, f"ft.group_restarts={self.group_restarts}: expected >= 0")
        _require(self.quorum_timeout_s > 0, f"ft.quorum_timeout_s={self.quorum_timeout_s}: expected seconds > 0")


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
    sweep: SweepConfig = field(default_factory=SweepConfig)
    ft: FtConfig = field(default_factory=FtConfig)

    def __post_init__(self) -> None:
        """Rules across sections (each section checked itself first)."""
        _require(self.data.seq_len <= self.model.max_position_embeddings or self.model.pretrained is not None,
                 f"data.seq_len={self.data.seq_len} exceeds model.max_position_embeddings="
                 f"{self.model.max_position_embeddings}")
        own_vocab = self.data.tokenizer is None and self.model.pretrained is None  # a BPE trained here, or synthetic
        _require(not own_vocab or self.model.vocab_size is None or self.data.vocab_size <= self.model.vocab_size,
                 f"data.vocab_size={self.data.vocab_size} exceeds model.vocab_size={self.model.vocab_size}: the "
                 "model could not embed the data's token ids; make them equal (or unset model.vocab_size)")
        window = self.profile.wait + self.profile.warmup + self.profile.active
        _require(not self.profile.enabled or window <= self.train.steps,
                 f"profile: wait {self.profile.wait} + warmup {self.profile.warmup} + active {self.profile.active} "
                 f"steps exceed train.steps={self.train.steps}")
        _require(not self.train.compile or self.parallel.engine == Engine.torch,
                 f"train.compile=true cannot be combined with parallel.engine={self.parallel.engine}: compiled "
                 "blocks are supported with parallel.engine=torch (DDP and the ZeRO stages)")
