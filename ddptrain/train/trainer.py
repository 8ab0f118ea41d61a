"""The trainer: one class, one file. Its parts are declared at the top; ``__init__`` builds them once, in the order
that keeps runs reproducible and resumable (seeds and collectives depend on it); ``forward_backward_step`` runs
one step's micro batches through forward and backward, ``train_step`` is one step top to bottom, ``train`` the
loop; ``summary`` writes the run's summary.

Everything that watches a step rather than computes it sits behind one object, the ``StepObserver``
(``train/observer.py``). What a test needs changed in a step is a step hook (``runtime/hooks.py``: fault injection,
``ddptrain/testing/faults.py``) or a subclass that overrides a method (``forward_backward_step``, ``accumulate``);
nothing replaces a module's function.

Sync points, where the host waits for the device or for other ranks, are marked where they happen. A steady
step has none besides the gradient collective (with fused AdamW, and except the step-breakdown timer's sampled
steps, ``metrics.sample_every``); check, logging and save steps sync by design.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, closing, nullcontext
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
from ddptrain.diagnose.whereabouts import WHEREABOUTS
from ddptrain.ft.layout import data_parallel_rank, data_parallel_size
from ddptrain.ft.replica import NoReplicas, ReplicaGroup, replicas_for
from ddptrain.models import build_model, model_vocab_size
from ddptrain.models.attention import ready_attention_masks, use_causal_attention, use_varlen_attention
from ddptrain.models.checkpointing import deprecation_line
from ddptrain.models.chunked_loss import chunked_loss_refusal, use_chunked_loss
from ddptrain.models.flops import attention_flops, flops_per_token, head_dim, pretrained_attention_flops
from ddptrain.models.lora import parameter_counts, prepare_for_finetuning, reentrant_failure, trainable_line
from ddptrain.models.packed_attention import check_packed_attention
from ddptrain.optim import build_optimizer, build_scheduler
from ddptrain.parallel import Wrapped, wrap_model
from ddptrain.parallel.compile import compile_blocks
from ddptrain.plan.analytic.planner import step_comm
from ddptrain.plan.costs import FP32
from ddptrain.plan.memory.own_peak import planned_peak
from ddptrain.plan.whatif.own_run import predict_own_step
from ddptrain.runtime.hooks import StepHooks
from ddptrain.runtime.process_group import DistEnv, device_precision, main_first, seed_everything
from ddptrain.runtime.starting import INTACT_CACHE, starting
from ddptrain.runtime.topology import gather_topology
from ddptrain.step.compute import (
    MicroStep,
    Stepped,
    accumulate_gradients,
    apply_update,
    clip_gradients,
    evaluate,
    global_mean,
    settle_nonfinite,
)
from ddptrain.step.control import NonFiniteSteps, Stopped, StopRequest, agree
from ddptrain.step.tokens import MicroBatch
from ddptrain.step.weighting import Weighting, weighting_for
from ddptrain.telemetry import Sinks
from ddptrain.telemetry.goodput import attempt_start, goodput_line
from ddptrain.telemetry.measured_peak import memory_peak
from ddptrain.telemetry.memory import ModelStateProbe
from ddptrain.telemetry.metrics import StepMetrics, TokenFlops, steady_medians
from ddptrain.telemetry.stragglers import StragglerMonitor
from ddptrain.telemetry.summary import RunSummary, SteadyFigures
from ddptrain.testing.faults import step_hooks
from ddptrain.train.components import RunShape, autocast_context, resume_target
from ddptrain.train.drift import DriftCheck
from ddptrain.train.loss_scale import LossScaler
from ddptrain.train.observer import StepObserver

log = logging.getLogger("ddptrain")


class Trainer:
    """The run being trained on this rank: its config, rank, device and directory, and every part the loop works
    with, built once by ``__init__``.

    Named for what it does rather than ``Run``, which names the composed config (``config.compose.Run``)."""

    cfg: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    resolved: dict[str, Any]  # the composed config as a plain dict (the sinks record it)
    started: float  # goodput's wall-clock start of this attempt (the launcher's, or this process's)
    hooks: StepHooks  # what acts at a step's start and end and in its loss: nothing, unless a test injects a fault
    shape: BatchShape  # the batch arithmetic, derived once: gbs = mbs x grad_accum x dp
    vocab: int  # the model's embedding rows (model.vocab_size or the data's rounded up; a pretrained model's own)
    model: torch.nn.Module  # the (adapted) model itself: parameters, clipping, evaluation, export
    precision: Precision  # train.precision resolved for this run's device (auto: bf16, fp16 or fp32)
    autocast: AbstractContextManager
    tokenizer: Any  # saved with checkpoints and the exported model; None for synthetic data
    n_params: int
    trainable: int  # parameters that train: all of them, or the adapters' when fine-tuning a frozen base
    wrapped: Wrapped  # the model as trained: torch DDP, FSDP2, one of our engines, or the bare model
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    batches: MicroBatches | StreamedBatches  # this rank's endless stream of training micro batches
    scaler: LossScaler | None  # train.precision=fp16 only
    checkpoints: CheckpointManager  # the stateful parts by key, and when they are saved
    start: int  # the step the run continues after: the resumed checkpoint's, else 0
    drift: DriftCheck  # the replicas' fingerprints at each check, and train.drift_policy
    val: list[torch.Tensor | MicroBatch]  # this rank's fixed validation batches
    flops_per_token: float
    metrics: StepMetrics
    sinks: Sinks
    probe: ModelStateProbe  # measures the model state every rank holds, once, on the first step
    stragglers: StragglerMonitor
    stop: StopRequest
    nonfinite: NonFiniteSteps  # each step's non-finite verdict, on the device until the next check
    weighting: Weighting  # how micro batches weigh into the gradient: the token mean for prompt/completion data
    observer: StepObserver  # timers, metrics, sync samples, memory peak, goodput, profiler, step hooks
    replicas: NoReplicas | ReplicaGroup  # the other replica groups (ft.replica_groups, torchft); none without
    dp_rank: int  # this rank's share of the global sample order: its rank, or G x N + rank in replica group G

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any],
                 shape: BatchShape | None = None) -> None:
        """Build every part of the run on this rank. ``shape``: the batch shape the caller derived (the worker,
        after ``data.micro_batch_size=auto`` is chosen); derived here when not given."""
        self.started = attempt_start()  # first: goodput's wall-clock counts the build
        self.cfg, self.env, self.device, self.run_dir, self.resolved = cfg, env, device, run_dir, resolved
        self.hooks = step_hooks(env.rank, cfg.ft.replica_id)  # first: a DDPTRAIN_FAULT it cannot read fails early
        self.shape = shape if shape is not None else BatchShape.from_config(cfg, data_parallel_size(cfg,
                                                                                                    env.world_size))
        self.dp_rank = data_parallel_rank(cfg, env.rank, env.world_size)
        topology = gather_topology(env)
        log.info("run dir %s | %d ranks on %s | %s | %s", run_dir, env.world_size, device.type,
                 topology.describe(), self.shape.equation())
        seed_everything(cfg.train.seed)

        with starting("preparing the data", f"cache {cfg.data.cache_dir}" if cfg.data.source != "synthetic" else "",
                      safe=INTACT_CACHE):
            data = main_first(env, lambda: build_token_data(cfg.data), cfg.data.prepare_timeout_s)
        self.tokenizer = data.tokenizer
        # A pretrained model brings its own embeddings (model.* shape keys then feed the planner only): they are
        # checked against the data's vocabulary as it loads.
        vocab = data.vocab_size if cfg.model.pretrained else model_vocab_size(cfg.model, data.vocab_size)
        with starting("building the model", cfg.model.pretrained or cfg.model.name):
            model = build_model(cfg.model, vocab, data.tokenizer.eos_token_id if data.tokenizer else None, device)
        self.vocab = model.get_input_embeddings().num_embeddings  # a pretrained model's own rows may be more
        self.precision = device_precision(cfg.train.precision, device)
        self.autocast = autocast_context(self.precision, device)
        packed_examples = cfg.data.format == DataFormat.prompt_completion and cfg.data.packing
        if cfg.data.format == DataFormat.packed:
            use_causal_attention(model)  # one causal sequence per row: no mask to build, no host read per forward
        elif packed_examples:  # examples packed in rows: FlashAttention's varlen kernel where it serves, else sdpa
            use_varlen_attention(model, device, self.precision)
        if note := deprecation_line(cfg.model):
            log.info(note)
        model = self.model = prepare_for_finetuning(model.to(device), cfg.model)
        if cfg.data.format == DataFormat.prompt_completion:
            ready_attention_masks(model)  # sdpa: one additive mask per micro batch, shared by every layer
        if packed_examples:  # before compiling and wrapping; as training runs
            check_packed_attention(model, data.vocab_size, self.autocast)
        if cfg.train.chunked_loss:
            chunk = use_chunked_loss(model, cfg.train.loss_chunk_tokens)
            log.info(f"train.chunked_loss: the LM head and the loss run {chunk} tokens at a time (no [tokens, "
                     "vocab] logits)" if chunk else f"train.chunked_loss: off: {chunked_loss_refusal(model)}; "
                     "full logits")
        self.trainable, self.n_params = parameter_counts(model)
        log.info("model %s: %.2fM parameters (%s) | %d train / %d val sequences", cfg.model.name,
                 self.n_params / 1e6, trainable_line(self.trainable, self.n_params, None), len(data.train),
                 len(data.val))
        if cfg.train.compile:
            blocks = compile_blocks(model, varying_shapes=cfg.data.format == DataFormat.prompt_completion)
            log.info("train.compile: compiling %d transformer blocks (on the first step)", blocks)
        if cfg.train.precision == Precision.auto:
            log.info("train.precision=auto: %s on this %s device", self.precision, device.type)
        self.wrapped = wrap_model(model, cfg.parallel, device, self.precision, env.local_world_size,
                                  timedelta(seconds=cfg.dist.timeout_s))
        # Every rank built the same initial weights from train.seed (and DDP broadcasts rank 0's). From here on each
        # rank draws from its own stream (dropout masks differ across ranks, as in one large-batch run);
        # checkpoints save and restore each rank's stream.
        seed_everything(cfg.train.seed + env.rank)
        self.optimizer = build_optimizer(model, cfg.optim, cfg.parallel.zero_stage)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.batches = self._batches(data)
        checkpointer = Checkpointer(cfg, run_dir, self.wrapped.strategy, data.tokenizer, self.hooks)
        checkpointer.check_room(model)
        self.scaler = (LossScaler(device, sharded=cfg.parallel.zero_stage >= 2)
                       if self.precision == Precision.fp16 else None)
        parts = {"scheduler": self.scheduler, "data": self.batches,
                 **({"grad_scaler": self.scaler} if self.scaler is not None else {}),
                 "run": RunShape(self.shape, cfg.parallel.zero_stage)}
        # the other replica groups (ft.*): before the resume, whose checkpoint holds DiLoCo's outer state
        self.replicas = replicas_for(cfg, env, run_dir, {"model": model, "optimizer": self.optimizer, **parts})
        parts.update(self.replicas.stateful())
        self.checkpoints = CheckpointManager(checkpointer, model, self.optimizer, parts, cfg.checkpoint.every_n_steps)
        self.start = self.checkpoints.resume(resume_target(cfg.train.resume))
        self.replicas.resumed(self.start)
        self.drift = DriftCheck(model, cfg.train.drift_policy, self.start)
        if env.world_size > 1:
            log.info(self.drift.describe())
        self.val = eval_batches(data.val, self.shape.micro_batch_size, self.shape.dp, self.dp_rank,
                                cfg.train.eval_batches, data.collate)
        flops = self._flops()
        self.flops_per_token = flops.per_token
        self._continue_token_count()
        self.metrics = StepMetrics(self.shape, device, flops, cfg.metrics, self.batches.tokens,
                                   self.batches.tokens_seen)
        self.sinks = Sinks.build(cfg.logger, env.is_main, run_dir, cfg.train.steps, resolved)
        try:
            self.probe = ModelStateProbe(model)
            if self.wrapped.outer is not model:  # a wrapper that may sync before the model's own forward (DDP,
                metrics = self.metrics  # our engines)
                model.register_forward_pre_hook(lambda *_: metrics.timer.inner_forward_started())
            self.stragglers = StragglerMonitor(topology.hosts, cfg.metrics.straggler_windows,
                                               cfg.metrics.straggler_pct)
            self.stop = StopRequest(cfg.launch.stop_grace_s, cfg.train.check_every, cfg.train.steps, self.start)
            self.nonfinite = NonFiniteSteps(device, cfg.train.check_every, fp16=self.scaler is not None)
            self.weighting = weighting_for(cfg.data.format)
            self.observer = StepObserver(self, self.started)
        except BaseException:
            self.sinks.close()
            raise

    def _batches(self, data: Any) -> MicroBatches | StreamedBatches:
        """This rank's endless stream of training micro batches: streamed, or drawn from the prepared shards."""
        cfg = self.cfg
        if cfg.data.streaming:
            return StreamedBatches(cfg.data, data.tokenizer, self.shape, self.dp_rank, self.device)
        return MicroBatches(data.train, self.shape, self.dp_rank, SampleOrder(cfg.train.seed, cfg.data.shuffle),
                            cfg.data.num_workers, self.device, data.collate)

    def _flops(self) -> TokenFlops:
        """Training FLOPs per token. A pretrained model's shape is not in model.*: 2N forward + 2N input gradients
        + 2 per trainable weight, and attention (no weights: the same frozen or not) from its own config."""
        cfg, seq_len = self.cfg, self.shape.seq_len
        if cfg.model.pretrained is None:
            attention = attention_flops(cfg.model.num_layers, cfg.model.num_heads, head_dim(cfg.model))
            return TokenFlops(flops_per_token(cfg.model, self.vocab, seq_len), attention)
        attention = pretrained_attention_flops(self.model.config)
        return TokenFlops(4.0 * self.n_params + 2.0 * self.trainable + attention * seq_len, attention)

    def _continue_token_count(self) -> None:
        """tokens_seen continues from the real tokens before the data position (the checkpoint's count, carried by
        the data part); a streamed run resumed from an earlier version's checkpoint, which has none, counts whole
        steps of fixed windows."""
        batches, start, per_step = self.batches, self.start, self.shape.tokens_per_step
        if isinstance(batches, StreamedBatches) and batches.tokens_seen is None:
            batches.tokens_seen = per_step * start
            log.info("the checkpoint records no token count (an earlier version's): tokens_seen continues from "
                     "%d steps x %d tokens", start, per_step)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def accumulate(self, step: int, micro_batches: Iterator[Any]) -> torch.Tensor:
        """Step ``step``'s micro batches through forward and backward (``accumulate_gradients``), timed, guarded
        and scaled as the observer and the run say; returns the step's loss."""
        watch = self.observer
        around = MicroStep(watch.phase, watch.loss_guard(step), watch.scale_loss(step, self.scale_loss))
        return accumulate_gradients(self.wrapped.outer, micro_batches, self.shape.grad_accum,
                                    self.wrapped.maybe_sync, self.autocast, self.weighting, around)

    def forward_backward_step(self, step: int, micro_batches: Iterator[Any]) -> torch.Tensor:
        """Step ``step``'s forward and backward over ``micro_batches``, weighted as the run chose, with what fault
        injection asks of this step's loss; the last micro batch's backward launches the gradient sync. Returns
        the step's loss. A reentrant-checkpointing failure becomes one line naming the key to change."""
        try:
            return self.accumulate(step, micro_batches)
        except RuntimeError as exc:
            if self.cfg.model.checkpoint_reentrant:
                raise reentrant_failure(exc) from exc
            raise

    def train_step(self, step: int, check: bool) -> Stepped:
        """Step ``step``: accumulate the gradients, clip them and update, skipped on the device (alike on every
        rank) when they are non-finite; then the learning rate's step. ``check``: also agree with the other ranks on
        the non-finite steps since the last check and on a stop request (the one sync point the caller asks for),
        and compare the replicas' parameters (``train/drift.py``).

        A skipped step also drops the compression hook's error feedback on every rank: what top-k or PowerSGD kept
        from a non-finite gradient would otherwise make every later step non-finite too."""
        cfg, watch = self.cfg, self.observer
        loss = self.forward_backward_step(step, self.batches)
        watch.after_backward(step)
        with watch.phase("optimizer"):
            loss = self.replicas.average(self.model, loss)  # across replica groups (else as is)
            if self.scaler is not None:
                self.scaler.unscale(self.optimizer)  # fp16: true gradients before the norm and clipping
            grad_norm = clip_gradients(self.model, cfg.optim.grad_clip, cfg.parallel.kernels)
            nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank (see guard_loss)
            committed = self.replicas.commit(step)  # False: a replica group failed in this step; taken again
            apply_update(self.optimizer, nonfinite if committed else torch.ones_like(nonfinite))  # sync point with
            # the foreach / for_loop kernels only
            self.replicas.updated(step)  # DiLoCo: a window's sync ran in that step's update (its quorum recorded)
            self.wrapped.step_done(nonfinite)  # sync point with PowerSGD's state only (see parallel/compression.py)
            if self.scaler is not None:
                self.scaler.update()  # fp16: an overflow halves the scale; a non-finite loss is a nan_policy event
            # No host read: the verdict waits for the next check (``loss``, this rank's, tells a non-finite loss
            # from an fp16 overflow there).
            self.nonfinite.record(step, nonfinite, loss)
            watch.after_update(step)
            stop = skipped = 0
            if check:
                # sync point: one small all-reduce and host read per check, never on the other steps; the
                # replicas' fingerprints ride on it (device work only until that read)
                agreed = agree(self.stop.signum, self.nonfinite, self.drift.words(self.device))
                self.drift.settle(agreed.fingerprints, step)  # more collectives only when replicas differ
                stop = agreed.stop
                if self.scaler is not None:
                    self.scaler.count_backoffs(agreed.overflows)
                skipped = settle_nonfinite(agreed.events, step, cfg.train.nan_policy)
        lr = self.scheduler.get_last_lr()[0]
        if committed:
            self.scheduler.step()
        return Stepped(loss, grad_norm, lr, stop, skipped)

    def train(self) -> dict[str, Any]:
        """Train on this rank (every rank runs this alike); returns the run's summary record, which rank 0 also
        writes to ``summary.json``."""
        cfg, watch = self.cfg, self.observer
        history: list[dict[str, Any]] = []
        skipped = 0  # updates skipped for a non-finite loss or gradient, as the checks learned of them
        first_loss: torch.Tensor | None = None  # step 1's loss on this rank (a fresh run only), read at the end
        step = self.start
        with closing(self.sinks), closing(self.replicas), watch:
            while step < cfg.train.steps:
                # the next step: after a heal from a peer (replica groups), the peers' next
                step = self.replicas.begin(step + 1)
                last = step == cfg.train.steps
                log_step = step % cfg.train.log_every == 0 or last
                check = log_step or self.checkpoints.due(step, last) or step % cfg.train.check_every == 0
                watch.started(step)
                if self.replicas.heal_seconds:
                    watch.goodput.recovered(self.replicas.heal_seconds, step - 1)
                self.stop.step = step  # what a stop request's notice counts from
                done = self.train_step(step, check)
                if step == 1:
                    first_loss = done.loss.detach()  # no host read: the summary reduces it
                skipped += done.skipped
                watch.after_step(step, log_step)
                # a save is not training time: goodput books it apart and the window leaves it out (a sync, on
                # the steps that save only)
                saving = self.metrics.excluded() if self.checkpoints.due(step, last) or done.stop else nullcontext()
                with watch.blocking("checkpoint"), saving:  # the last save is committed before exit
                    saved = self.checkpoints.maybe_save(step, last=last, stop=bool(done.stop))
                if log_step or done.stop:  # a stop's step is logged too: metrics.jsonl ends where the run stopped
                    history.append(self.log_window(step, done, skipped))
                if done.stop:
                    watch.after_save(step, saved, record=True)
                    self.stop.restore()
                    raise Stopped(f"stopped by {signal.Signals(done.stop).name} after step {step}; checkpoint saved"
                                  f" in {self.checkpoints.root}; continue with train.resume=auto", done.stop)
                watch.after_save(step, saved, record=log_step)
            self.stop.restore()
            if cfg.checkpoint.export:
                self.checkpoints.export(self.run_dir)
            return self.summary(history, first_loss)  # sinks open

    def log_window(self, step: int, done: Stepped, skipped: int) -> dict[str, Any]:
        """A logging step: the window's metrics (validation loss on evaluation steps) to the sinks; returns them."""
        cfg = self.cfg
        # sync points: the loss mean (an all-reduce), the gradient norm's host read, the straggler gather
        WHEREABOUTS.at("loss mean")
        record = self.metrics.window(step, global_mean(done.loss), done.lr, float(done.grad_norm))
        record["skipped_steps"] = skipped
        record.update(self.replicas.window())
        if self.scaler is not None:
            record.update(self.scaler.window())
        record.update(self.stragglers.window(record))
        if _every(step, cfg.train.eval_every) or (cfg.train.eval_every and step == cfg.train.steps):
            with self.observer.blocking("eval"):
                record["val_loss"] = evaluate(self.model, self.val, self.autocast, self.device)
        self.sinks.log(record)
        self.metrics.restart_window()
        return record

    def summary(self, history: list[dict[str, Any]], first_loss: torch.Tensor | None = None) -> dict[str, Any]:
        """The run's summary: steady-state medians (first window skipped), config essentials, its own predicted
        step and memory peak and (rank 0) the run's goodput, the last figure taken. Rank 0 writes
        ``summary.json``, reports goodput to the sinks and logs it last. Returns the summary's JSON record.

        The losses: step 1's (``first_loss``, this rank's, averaged over the ranks here: every rank has one or
        none alike, as every rank resumed alike), the first logged window's with its step, the last window's, and
        the last evaluation's.

        Gradients, hence communication, exist for the trainable parameters only. ``buckets``: the last timed
        step's gradient buckets as (seconds before backward compute ended that each was ready, bytes), which
        calibrate the what-if predictor (``plan.from_run``)."""
        cfg, env, shape, first = self.cfg, self.env, self.shape, self.observer.first
        predicted_comm = step_comm(self.trainable, shape.dp, cfg.parallel.zero_stage, FP32)
        summary = RunSummary(
            world_size=shape.dp, model=cfg.model.name, parameters=self.n_params,
            trainable_parameters=self.trainable, engine=cfg.parallel.engine, zero_stage=cfg.parallel.zero_stage,
            compression=cfg.parallel.compression, wrapper=self.wrapped.strategy,
            global_batch_size=shape.global_batch_size, micro_batch_size=shape.micro_batch_size,
            grad_accum=shape.grad_accum, seq_len=shape.seq_len, steps=cfg.train.steps,
            first_step_loss=global_mean(first_loss) if first_loss is not None else None,  # sync: one all-reduce
            first_logged_step=history[0]["step"] if history else None,
            first_logged_loss=history[0]["loss"] if history else None,
            final_loss=history[-1]["loss"] if history else None,
            final_val_loss=next((m["val_loss"] for m in reversed(history) if "val_loss" in m), None),
            tokens_seen=history[-1]["tokens_seen"] if history else None,  # since step 1, a resumed run's included
            steady=SteadyFigures(steady_medians(history) if history else {}),
            flops_per_token=self.flops_per_token, peak_tflops=self.metrics.peak_tflops,
            predicted={
                # All-reduce of fp32 gradients: payload S = 4Ψ; each rank sends 2(N-1)/N·S (what the plan prints).
                "comm_payload_bytes": (4.0 * self.trainable if cfg.parallel.zero_stage < 2 and shape.dp > 1
                                       else None),
                "comm_link_bytes_per_rank": predicted_comm.nbytes,
            },
            model_state=first.model_state,
            buckets=[[lead, nbytes] for lead, nbytes in self.metrics.buckets],
            compile_s=first.compile_s,
        )
        summary.predicted.update(predict_own_step(summary, cfg.plan, self.device.type, env.num_nodes))
        if self.scaler is not None:
            summary.loss_scale = self.scaler.window()  # this rank's final scale and back-offs (alike on every rank)
        if env.is_main:  # a trace of seconds for a small model; every rank plans the same, so rank 0 alone does
            planned = planned_peak(cfg, env.world_size, self.device, self.vocab, self.n_params)
            summary.memory_peak = memory_peak(planned, self.observer.peak, cfg.train.steps)
            summary.goodput = self.observer.goodput.report()  # the wall-clock ends here
            record = self.replicas.summarize(summary.to_json())
            (self.run_dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
            self.sinks.summary(summary.goodput)
            log.info("%s", goodput_line(summary.goodput))
            return record
        return summary.to_json()


def train(cfg: Config, env: DistEnv, device: torch.device, run_dir: Path, resolved: dict[str, Any],
          shape: BatchShape | None = None) -> dict[str, Any]:
    """Build the trainer on this rank and train; returns the run's summary record (``Trainer.train``)."""
    return Trainer(cfg, env, device, run_dir, resolved, shape).train()


def _every(step: int, period: int) -> bool:
    """True every ``period`` steps; never when the period is 0 (disabled)."""
    return period > 0 and step % period == 0
