"""Dry-run planner: batch split, per-rank memory, communication and overlap of a data-parallel run, no GPU needed.

Memory follows the ZeRO paper's model-state accounting (Rajbhandari et al. 2020, §3 and §5) for the state that
ddptrain's wrappers keep (fp32 parameters, gradients and AdamW state; FSDP2's gathered working copy); communication
follows ring collectives in the α–β model, in which each rank sends (N−1)/N of the buffer per pass.
Activations are not modelled: the numbers are model state and gradient traffic only.
``ddptrain/plan/analytic/render.py`` turns a ``Plan`` into the text the dry run prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ddptrain.config.choices import ZERO_STAGES, DataFormat, resolve_precision
from ddptrain.config.schema import Config
from ddptrain.data.batch import BatchShape
from ddptrain.errors import ConfigError
from ddptrain.models.build import model_vocab_size
from ddptrain.models.flops import attention_flops, count_params, flops_per_token, head_dim, lora_param_count
from ddptrain.plan.costs import FP32, INTERCONNECTS, MIXED_BF16, MIXED_FP16, Comm, Link, StateBytes, chosen_link
from ddptrain.plan.measured import measured_lengths
from ddptrain.telemetry.peak import peak_tflops

ASSUMED_MFU = 0.4  # a well-tuned dense LLM run reaches 35–50% of the bf16 peak


@dataclass(frozen=True)
class Memory:
    """Bytes of model state on one rank, by component."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_by_dtype(
    params: float, world_size: int, stage: int, precision: StateBytes = MIXED_BF16, gathered: float = 0.0
) -> dict[str, dict[str, float]]:
    """Per-rank model state under ZeRO ``stage`` by component and dtype: 1 shards the optimizer state, 2 also
    gradients, 3 also parameters.

    Under FSDP2 (stages 2-3) each rank keeps its fp32 shard of every parameter (the copy AdamW updates) and, while
    a unit is gathered, the unit's unsharded working copy in the policy's dtype: every parameter from forward to
    the end of backward at stage 2; at stage 3 only ``gathered`` parameters at the peak (in forward: the root's,
    gathered for the whole forward, plus the largest block).
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0–3, got {stage}")
    sharded = params / world_size
    master = precision.param_bytes * (sharded if stage >= 2 else params)
    working = precision.gathered_bytes * (params if stage == 2 else gathered if stage == 3 else 0.0)
    parameters = {"float32": master}
    parameters[precision.gathered_dtype] = parameters.get(precision.gathered_dtype, 0.0) + working
    return {
        "parameters": {dtype: n for dtype, n in parameters.items() if n},
        "gradients": {"float32": precision.grad_bytes * (sharded if stage >= 2 else params)},
        "optimizer": {"float32": precision.optim_bytes * (sharded if stage >= 1 else params)},
    }


def model_state_memory(
    params: float, world_size: int, stage: int, precision: StateBytes = MIXED_BF16, gathered: float = 0.0
) -> Memory:
    """Per-rank model state under ZeRO ``stage``, by component (``model_state_by_dtype`` summed over dtypes)."""
    by_dtype = model_state_by_dtype(params, world_size, stage, precision, gathered)
    params_b, grads_b, optim_b = (sum(by_dtype[c].values()) for c in ("parameters", "gradients", "optimizer"))
    return Memory(params=params_b, grads=grads_b, optimizer=optim_b)


# Bytes per frozen base weight. NF4: 4 bits + double-quantized block scales (8-bit absmax per 64 weights, one fp32
# per 256 absmax values: 0.127 bits, QLoRA paper section 2); embeddings stay fp32 (peft's k-bit preparation).
FROZEN_BYTES = {"fp32": 4.0, "bf16": 2.0, "nf4": (4 + 8 / 64 + 32 / (64 * 256)) / 8}


def finetune_memory(params: float, trainable: float, base_bytes: float, world_size: int, stage: int) -> Memory:
    """Per-rank model state with a frozen base: base weights at ``base_bytes`` each, fp32 adapters with fp32
    gradients and AdamW state (8 bytes), sharded per ZeRO ``stage`` like full training."""
    full = model_state_memory(trainable, world_size, stage, FP32)
    base = base_bytes * (params - trainable) / (world_size if stage >= 3 else 1)
    return Memory(params=base + full.params, grads=full.grads, optimizer=full.optimizer)


def step_comm(params: float, world_size: int, stage: int, precision: StateBytes = MIXED_BF16) -> Comm:
    """Per-rank traffic of one step, as the ZeRO paper counts it (per micro-batch under ZeRO-3).

    Stage 0 all-reduces gradients; stages 1–2 reduce-scatter gradients and all-gather the updated parameters
    (the same 2Ψ); stage 3 all-gathers parameters in forward and again in backward and reduce-scatters
    gradients (3Ψ) in every micro-batch, accumulated or not.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 0–3, got {stage}")
    share = (world_size - 1) / world_size * params
    if stage == 0:
        return Comm(2 * share * precision.grad_bytes, 2 * (world_size - 1))
    # ZeroRedundancyOptimizer sends the updated fp32 parameters; FSDP2 gathers them in its policy's dtype
    gather = precision.param_bytes if stage == 1 else precision.gathered_bytes
    if stage < 3:
        return Comm(share * (precision.grad_bytes + gather), 2 * (world_size - 1))
    return Comm(share * (2 * gather + precision.grad_bytes), 3 * (world_size - 1))


def backward_seconds(flops_per_token: float, tokens: float, peak_tflops: float, mfu: float = ASSUMED_MFU) -> float:
    """Backward ≈ 2× forward, so it does 4/6 of the training FLOPs, here at ``mfu`` of the peak."""
    return (4 / 6) * flops_per_token * tokens / (peak_tflops * 1e12 * mfu)


@dataclass(frozen=True)
class Plan:
    """Every number the dry run prints; ``memory`` and ``comm`` hold all four ZeRO stages."""

    params: float
    params_source: str
    trainable: float  # parameters with gradients: all of them, or the LoRA adapters (the rest is frozen)
    frozen_note: str  # how the frozen base is held ("" when everything trains)
    flops_per_token: float
    flops_rule: str
    batch: BatchShape
    zero_stage: int
    precision: StateBytes
    memory: dict[int, Memory]
    comm: dict[int, Comm]
    links: list[Link]
    link: Link  # the one the overlap verdict uses
    peak_tflops: float | None
    assumed_mfu: float
    backward_s: float | None  # one micro-batch's backward, which the gradient sync can hide under
    # real tokens per sequence: seq_len for fixed blocks; for prompt/completion rows the plan.from_run run's
    # measured figure, else seq_len (an upper bound: rows are shorter)
    sequence_tokens: float

    @property
    def comm_s(self) -> float:
        return self.link.seconds(self.comm[self.zero_stage])

    @property
    def overlap_ratio(self) -> float | None:
        """Communication time over backward time: at most 1 means the sync can hide under backward."""
        return None if self.backward_s is None else self.comm_s / self.backward_s


def build_plan(
    cfg: Config | DictConfig, world_size: int, device_name: str | None, assumed_mfu: float = ASSUMED_MFU,
    bf16_capable: bool = True,
) -> Plan:
    """Plan a run from the composed config; ``cfg.plan.world_size`` overrides the launch's ``world_size``.

    With ``cfg.plan.params`` set, the model is that many parameters and FLOPs per token are 6·params (no shape,
    so no attention term). ``device_name`` None means a CPU: fp32 under precision=auto, and no overlap verdict
    unless ``cfg.metrics.peak_tflops`` is given. A GPU without bf16 (``bf16_capable`` False) resolves auto to fp16.
    """
    batch = BatchShape.from_config(cfg, cfg.plan.world_size or world_size)
    n = batch.dp
    # prompt/completion rows hold fewer real tokens than seq_len: the lengths a run of this data measured
    lengths = measured_lengths(cfg.plan.from_run) if cfg.data.format == DataFormat.prompt_completion else None
    sequence_tokens = lengths[0] if lengths is not None else float(batch.seq_len)
    lora = cfg.model.lora.enabled
    if cfg.plan.params:
        params, source = float(cfg.plan.params), "plan.params"
        flops, rule = 6.0 * params, "6·params"
        if lora and not cfg.plan.trainable_params:
            raise ConfigError("plan.trainable_params: expected the adapter parameter count with plan.params and "
                              "model.lora.enabled=true")
        adapters, embedding = float(cfg.plan.trainable_params or 0), 0.0
        gathered = 0.0  # no shape: ZeRO-3's gathered working copy is not modelled
    else:
        vocab = model_vocab_size(cfg.model, cfg.data.vocab_size)
        counts = count_params(cfg.model, vocab)
        params, source = float(counts.total), f"model {cfg.model.name}"
        flops, rule = flops_per_token(cfg.model, vocab, batch.seq_len), "6·matmul params + 12·L·H·Q·T"
        if lengths is not None:  # attention over each sequence's own length: 12·L·H·Q per token of Σ T² / Σ T
            flops += attention_flops(cfg.model.num_layers, cfg.model.num_heads, head_dim(cfg.model)) * (
                lengths[1] - batch.seq_len)
            rule = f"6·matmul params + 12·L·H·Q·(Σ T² / Σ T = {lengths[1]:.1f}, measured by plan.from_run)"
        adapters, embedding = float(lora_param_count(cfg.model)), float(counts.embedding)
        # ZeRO-3 gathers the root's parameters (embeddings, head, final norm) and one block at a time in forward
        gathered = counts.embedding + counts.non_embedding / cfg.model.num_layers
    on_gpu = device_name is not None
    resolved = resolve_precision(cfg.train.precision, "cuda" if on_gpu else "cpu", bf16_capable)
    precision = {"fp32": FP32, "fp16": MIXED_FP16, "bf16": MIXED_BF16}[resolved]
    trainable, note, base_bytes = params, "", float(precision.param_bytes)
    if lora:  # adapters train in fp32 on a frozen base: only they have gradients, optimizer state and traffic
        params, trainable, precision = params + adapters, adapters, FP32
        quant = str(cfg.model.quantize) if cfg.model.quantize != "none" else str(cfg.model.dtype)
        base_bytes = (FROZEN_BYTES[quant] * (params - adapters - embedding) + 4.0 * embedding) / (params - adapters)
        note = f"frozen base in {quant}, {base_bytes:.3g} bytes per weight"
    link = chosen_link(cfg.plan)
    links = {**INTERCONNECTS, link.name: link}  # the chosen link replaces its preset, or joins as "measured"
    peak = cfg.metrics.peak_tflops or (peak_tflops(device_name) if on_gpu else None)
    micro_tokens = batch.micro_batch_size * sequence_tokens
    return Plan(
        params=params,
        params_source=source,
        trainable=trainable,
        frozen_note=note,
        flops_per_token=flops,
        flops_rule=rule,
        batch=batch,
        zero_stage=cfg.parallel.zero_stage,
        precision=precision,
        memory={s: finetune_memory(params, trainable, base_bytes, n, s) if lora
                else model_state_memory(params, n, s, precision, gathered) for s in ZERO_STAGES},
        comm={s: step_comm(trainable, n, s, precision) for s in ZERO_STAGES},
        links=list(links.values()),
        link=link,
        peak_tflops=peak,
        assumed_mfu=assumed_mfu,
        backward_s=backward_seconds(flops, micro_tokens, peak, assumed_mfu) if peak else None,
        sequence_tokens=sequence_tokens,
    )
