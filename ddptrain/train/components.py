"""The build step of ``train()``: everything a run builds once before its loop, resumed from a checkpoint if asked.

``build_trainer`` builds data, model, wrapper, optimizer, schedule, batches, checkpoints and telemetry in
one fixed order (seeds and collectives depend on it). The stateful parts are handed to the checkpoint manager by
key, each giving and taking its own ``state_dict``, and the run resumes through it; the loop then only says
``maybe_save(step, ...)``. This is also the one place that gives the loop and the checkpointer their step hooks
(fault injection, when ``DDPTRAIN_FAULT`` asks for it).
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddptrain.checkpoint import Checkpointer, CheckpointManager
from ddptrain.config.choices import DataFormat, Precision
from ddptrain.config.schema import Config
from ddptrain.data import BatchShape, MicroBatches, SampleOrder, build_token_data, eval_batches
from ddptrain.data.streaming import StreamedBatches
from ddptrain.models import build_model, model_vocab_size
from ddptrain.models.attention import ready_attention_masks, use_causal_attention, use_varlen_attention
from ddptrain.models.checkpointing import deprecation_line
from ddptrain.models.chunked_loss import chunked_loss_refusal, use_chunked_loss
from ddptrain.models.flops import attention_flops, flops_per_token, head_dim, pretrained_attention_flops
from ddptrain.models.lora import parameter_counts, prepare_for_finetuning, trainable_line
from ddptrain.models.packed_attention import check_packed_attention
from ddptrain.optim import build_optimizer, build_scheduler
from ddptrain.parallel import Wrapped, wrap_model
from ddptrain.parallel.compile import compile_blocks
from ddptrain.runtime.hooks import StepHooks
from ddptrain.runtime.process_group import DistEnv, device_precision, main_first, seed_everything
from ddptrain.runtime.topology import gather_topology
from ddptrain.telemetry import Sinks
from ddptrain.telemetry.memory import ModelStateProbe
from ddptrain.telemetry.metrics import StepMetrics, TokenFlops
from ddptrain.telemetry.stragglers import StragglerMonitor
from ddptrain.testing.faults import step_hooks
from ddptrain.train.control import NonFiniteSteps, StopRequest
from ddptrain.train.drift import DriftCheck
from ddptrain.train.loss_scale import LossScaler
from ddptrain.train.tokens import MicroBatch
from ddptrain.train.weighting import Weighting, weighting_for

log = logging.getLogger("ddptrain")


@dataclass
class Trainer:
    """The run being trained on this rank: its config, rank, device and directory, and every part the loop works
    with; built once by ``build_trainer``, then handed whole to the step and the loop's helpers.

    Named for what it does rather than ``Run``, which names the composed config (``config.compose.Run``)."""

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    shape: BatchShape  # the batch arithmetic, derived once: gbs = mbs x grad_accum x dp
    model: torch.nn.Module  # the (adapted) model itself: parameters, clipping, evaluation, export
    wrapped: Wrapped  # the model as trained: torch DDP, FSDP2, one of our engines, or the bare model
    tokenizer: Any  # saved with checkpoints and the exported model; None for synthetic data
    n_params: int
    trainable: int  # parameters that train: all of them, or the adapters' when fine-tuning a frozen base
    flops_per_token: float
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    batches: MicroBatches | StreamedBatches  # this rank's endless stream of training micro batches
    weighting: Weighting  # how micro batches weigh into the gradient: the token mean for prompt/completion data
    val: list[torch.Tensor | MicroBatch]  # this rank's fixed validation batches
    autocast: AbstractContextManager
    checkpoints: CheckpointManager  # the stateful parts by key, and when they are saved
    start: int  # the step the run continues after: the resumed checkpoint's, else 0
    metrics: StepMetrics
    sinks: Sinks
    probe: ModelStateProbe  # measures the model state every rank holds, once, on the first step
    stragglers: StragglerMonitor
    stop: StopRequest
    scaler: LossScaler | None  # train.precision=fp16 only
    nonfinite: NonFiniteSteps  # each step's non-finite verdict, on the device until the next check
    drift: DriftCheck  # the replicas' fingerprints at each check, and train.drift_policy
    precision: Precision  # train.precision resolved for this run's device (auto: bf16, fp16 or fp32)
    hooks: StepHooks  # what acts at a step's start and end and in its loss: nothing, unless a test injects a fault

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss


def build_trainer(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any]
                  ) -> Trainer:
    """Build every part of the run on this rank, in the order that keeps runs reproducible and resumable."""
    hooks = step_hooks(env.rank)  # first: a DDPTRAIN_FAULT it cannot read fails before anything is built
    shape = BatchShape.from_config(cfg, env.world_size)
    topology = gather_topology(env)
    log.info("run dir %s | %d ranks on %s | %s | %s", run_dir, env.world_size, device.type, topology.describe(),
             shape.equation())
    seed_everything(cfg.train.seed)

    data = main_first(env, lambda: build_token_data(cfg.data), cfg.data.prepare_timeout_s)
    # A pretrained model brings its own embeddings (model.* shape keys then feed the planner only): they are
    # checked against the data's vocabulary as it loads.
    vocab = data.vocab_size if cfg.model.pretrained else model_vocab_size(cfg.model, data.vocab_size)
    model = build_model(cfg.model, vocab, data.tokenizer.eos_token_id if data.tokenizer else None, device)
    precision = device_precision(cfg.train.precision, device)
    autocast = autocast_context(precision, device)
    packed_examples = cfg.data.format == DataFormat.prompt_completion and cfg.data.packing
    if cfg.data.format == DataFormat.packed:
        use_causal_attention(model)  # one causal sequence per row: no mask to build, no host read per forward
    elif packed_examples:  # examples packed in rows: FlashAttention's varlen kernel where it serves, else sdpa
        use_varlen_attention(model, device, precision)
    if note := deprecation_line(cfg.model):
        log.info(note)
    model = prepare_for_finetuning(model.to(device), cfg.model)
    if cfg.data.format == DataFormat.prompt_completion:
        ready_attention_masks(model)  # sdpa: one additive mask per micro batch, shared by every layer
    if packed_examples:
        check_packed_attention(model, data.vocab_size, autocast)  # before compiling and wrapping; as training runs
    if cfg.train.chunked_loss:
        chunk = use_chunked_loss(model, cfg.train.loss_chunk_tokens)
        log.info(f"train.chunked_loss: the LM head and the loss run {chunk} tokens at a time (no [tokens, vocab] "
                 "logits)" if chunk else f"train.chunked_loss: off: {chunked_loss_refusal(model)}; full logits")
    trainable, n_params = parameter_counts(model)
    log.info("model %s: %.2fM parameters (%s) | %d train / %d val sequences", cfg.model.name, n_params / 1e6,
             trainable_line(trainable, n_params, None), len(data.train), len(data.val))
    if cfg.train.compile:
        blocks = compile_blocks(model, varying_shapes=cfg.data.format == DataFormat.prompt_completion)
        log.info("train.compile: compiling %d transformer blocks (on the first step)", blocks)
    if cfg.train.precision == Precision.auto:
        log.info("train.precision=auto: %s on this %s device", precision, device.type)
    wrapped = wrap_model(model, cfg.parallel, device, precision, env.local_world_size,
                         timedelta(seconds=cfg.dist.timeout_s))
    # Every rank built the same initial weights from train.seed (and DDP broadcasts rank 0's). From here on each
    # rank draws from its own stream (dropout masks differ across ranks, as in one large-batch run); checkpoints
    # save and restore each rank's stream.
    seed_everything(cfg.train.seed + env.rank)
    optimizer = build_optimizer(model, cfg.optim, cfg.parallel.zero_stage)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    batches: MicroBatches | StreamedBatches
    if cfg.data.streaming:
        batches = StreamedBatches(cfg.data, data.tokenizer, shape, env.rank, device)
    else:
        batches = MicroBatches(data.train, shape, env.rank, SampleOrder(cfg.train.seed, cfg.data.shuffle),
                               cfg.data.num_workers, device, data.collate)
    checkpointer = Checkpointer(cfg, run_dir, wrapped.strategy, data.tokenizer, hooks)
    checkpointer.check_room(model)
    scaler = LossScaler(device, sharded=cfg.parallel.zero_stage >= 2) if precision == Precision.fp16 else None
    parts = {"scheduler": scheduler, "data": batches, **({"grad_scaler": scaler} if scaler is not None else {}),
             "run": RunShape(shape, cfg.parallel.zero_stage)}
    checkpoints = CheckpointManager(checkpointer, model, optimizer, parts, cfg.checkpoint.every_n_steps)
    start = checkpoints.resume(resume_target(cfg.train.resume))
    drift = DriftCheck(model, cfg.train.drift_policy, start)
    if env.world_size > 1:
        log.info(drift.describe())
    val = eval_batches(data.val, shape.micro_batch_size, shape.dp, env.rank, cfg.train.eval_batches, data.collate)
    # A pretrained model's shape is not in model.*: 2N forward + 2N input gradients + 2 per trainable weight, and
    # attention (no weights: the same frozen or not) from its own config.
    if cfg.model.pretrained is None:
        fpt = flops_per_token(cfg.model, vocab, shape.seq_len)
        attention = attention_flops(cfg.model.num_layers, cfg.model.num_heads, head_dim(cfg.model))
    else:
        attention = pretrained_attention_flops(model.config)
        fpt = 4.0 * n_params + 2.0 * trainable + attention * shape.seq_len
    # tokens_seen continues from the real tokens before the data position (the checkpoint's count, carried by the
    # data part); a streamed run resumed from an earlier version's checkpoint, which has none, counts whole steps
    # of fixed windows.
    if isinstance(batches, StreamedBatches) and batches.tokens_seen is None:
        batches.tokens_seen = shape.tokens_per_step * start
        log.info("the checkpoint records no token count (an earlier version's): tokens_seen continues from "
                 "%d steps x %d tokens", start, shape.tokens_per_step)
    counted = batches.tokens_seen
    metrics = StepMetrics(shape, device, TokenFlops(fpt, attention), cfg.metrics, batches.tokens, counted)
    sinks = Sinks.build(cfg.logger, env.is_main, run_dir, cfg.train.steps, resolved)
    probe = ModelStateProbe(model)
    if wrapped.outer is not model:  # a wrapper that may sync before the model's own forward (DDP, our engines)
        model.register_forward_pre_hook(lambda *_: metrics.timer.inner_forward_started())
    return Trainer(
        cfg=cfg, env=env, device=device, run_dir=run_dir, shape=shape, model=model, wrapped=wrapped,
        tokenizer=data.tokenizer, n_params=n_params, trainable=trainable,
        flops_per_token=fpt, optimizer=optimizer, scheduler=scheduler, batches=batches,
        weighting=weighting_for(cfg.data.format), val=val,
        autocast=autocast, checkpoints=checkpoints, start=start,
        metrics=metrics, sinks=sinks, probe=probe,
        stragglers=StragglerMonitor(topology.hosts, cfg.metrics.straggler_windows, cfg.metrics.straggler_pct),
        stop=StopRequest(cfg.launch.stop_grace_s), scaler=scaler,
        nonfinite=NonFiniteSteps(device, cfg.train.check_every, fp16=scaler is not None), drift=drift,
        precision=precision, hooks=hooks,
    )


def resume_target(configured: str | None) -> str | None:
    """``train.resume``, except that a worker restarted by the elastic agent always continues (auto)."""
    if configured is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        log.warning("restarted by the elastic agent (or Ray Train): resuming from the latest checkpoint "
                    "(train.resume=auto)")
        return "auto"
    return configured


class RunShape:
    """The batch a run trains with, recorded in every checkpoint; a resumed run says what changed since."""

    def __init__(self, shape: BatchShape, zero_stage: int) -> None:
        self.shape = shape
        self.zero_stage = zero_stage

    def state_dict(self) -> dict[str, int]:
        return {"world_size": self.shape.dp, "global_batch_size": self.shape.global_batch_size,
                "zero_stage": self.zero_stage}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        shape = self.shape
        if saved["world_size"] != shape.dp:
            log.warning("resuming on %d ranks from a checkpoint of %d: grad_accum %d keeps the global batch of %d",
                        shape.dp, saved["world_size"], shape.grad_accum, shape.global_batch_size)
        if saved["global_batch_size"] != shape.global_batch_size:
            log.warning("the checkpoint trained with a global batch of %d; continuing with %d",
                        saved["global_batch_size"], shape.global_batch_size)


def autocast_context(precision: Precision, device: torch.device) -> AbstractContextManager:
    """Autocast in the resolved precision (``runtime.device_precision``): bf16, fp16 (with a loss scaler,
    ``train/loss_scale.py``) or none for fp32."""
    if precision == Precision.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    if precision == Precision.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
