"""Peak memory of one training step, traced on fake tensors: what the step allocates, op by op, with no memory.

The model is built on ``meta`` and materialised as fake tensors (``FakeTensorMode``); the trainer's own step
(``ddptrain/step/compute.py``: the micro batches' forward and backward with the run's weighting, loss guard and
gradient sync switch, clipping, the update) then runs with every op's output shapes and dtypes but no data.
``PeakTracker`` follows each tensor storage from the op that creates it to the moment it is freed, sums the live
bytes by category and keeps the category split at the global peak. An NF4 base is held as bitsandbytes holds
it (``ddptrain/plan/memory/nf4.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM, PreTrainedModel

from ddptrain.config.choices import DataFormat, Quantize
from ddptrain.config.schema import Config, DataConfig, ModelConfig
from ddptrain.models import chunked_loss
from ddptrain.models.attention import ready_attention_masks, use_causal_attention
from ddptrain.models.build import hf_config, with_named_loss
from ddptrain.models.chunked_loss import causal_lm_of, use_chunked_loss
from ddptrain.models.lora import DTYPES, prepare_for_finetuning
from ddptrain.optim import impl_kwargs, param_groups
from ddptrain.parallel.wrap import sync_switch
from ddptrain.plan.memory.cuda_autocast import cuda_autocast_policy
from ddptrain.step.compute import MicroStep, accumulate_gradients, apply_update, clip_gradients
from ddptrain.step.tokens import MicroBatch
from ddptrain.step.weighting import weighting_for
from ddptrain.telemetry.storage_peak import (  # the tracker the run measures its own peak with, too
    PeakTracker,
    model_state_tensors,
    step_tracker,
)

ACCUMULATING = " (accumulating)"  # the phases of a later micro batch, beside the earlier ones' gradients


@dataclass(frozen=True)
class StepSetup:
    """How the traced step runs: what the target device would run, not what this machine would."""

    device_type: str  # "cuda" or "cpu": the device whose AdamW implementation the step runs
    compute_dtype: torch.dtype | None  # autocast dtype; None: fp32
    grad_clip: float
    grad_accum: int = 1
    data_format: DataFormat = DataFormat.packed  # how the run's micro batches come and weigh (``weighting_for``)


def finite_verdict() -> torch.Tensor:
    """The non-finite verdict ``apply_update`` takes, for a planned step: finite, so the update runs. Made with
    ``torch.tensor``, which under ``FakeTensorMode`` keeps its value: the host can read it (the foreach and
    for_loop kernels branch on it), where a verdict computed from fake gradients has no value to read."""
    return torch.tensor(False)


def create_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
    """One update on zero gradients: the optimizer state exists before the traced step, as in any step but the
    first."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    apply_update(optimizer, finite_verdict())


class TracedPhases:
    """The step's phases (``Phase``: "data", "forward", "backward") as the tracker files what they allocate: a micro
    batch's data and forward under "forward", its backward under "backward"; a later micro batch's with
    ``ACCUMULATING`` (they run beside the earlier ones' gradients)."""

    def __init__(self, tracker: PeakTracker) -> None:
        self.tracker = tracker
        self.backwards = 0

    def __call__(self, name: str) -> AbstractContextManager:
        later = ACCUMULATING if self.backwards else ""
        self.tracker.phase = ("backward" if name == "backward" else "forward") + later
        self.backwards += name == "backward"
        return nullcontext()


def loader_micro_batch(batch: dict[str, torch.Tensor], data_format: DataFormat) -> torch.Tensor | MicroBatch:
    """``batch`` (the model's inputs) as the run's loader hands a micro batch to the step: packed blocks as their
    token rows (the labels are the tokens), prompt/completion batches as they are."""
    return batch if data_format == DataFormat.prompt_completion else batch["input_ids"]


ALL_CHUNK_STARTS = chunked_loss.chunk_starts  # the run's: every chunk


def representative_chunk_starts(tokens: int, chunk: int) -> list[int]:
    """The chunked loss's first two chunks and its last. The gradients the chunks fill are allocated before the
    loop, so every full chunk after the first allocates and frees what the second does: the step's peak is the
    same, and a fake step of many thousand tokens runs three chunks' ops instead of hundreds."""
    starts = ALL_CHUNK_STARTS(tokens, chunk)
    return sorted({*starts[:2], starts[-1]})


def trace_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], setup: StepSetup
) -> tuple[PeakTracker, int]:
    """One training step under ``PeakTracker``, the trainer's own (``ddptrain/step/compute.py``): ``grad_accum``
    micro batches of ``batch`` through ``accumulate_gradients`` (the run's weighting for ``setup.data_format``,
    counted on this rank alone; its loss guard; the gradient sync skipped but on the last), ``clip_gradients``
    on torch's kernels, and ``apply_update`` on a finite verdict.

    Works the same on fake and on real tensors, on a bare model and on a torch DDP or FSDP2 one (the validation
    runs them). Returns the tracker (the peak, and each phase's) and how many attention calls ran a flash kernel.
    """
    tracker = step_tracker(model, setup.device_type)
    params, state = model_state_tensors(model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.mark([p.grad], "gradients")) for p in trainable]
    autocast = (torch.autocast("cpu", dtype=setup.compute_dtype) if setup.compute_dtype is not None
                else nullcontext())
    micro_batches = itertools.repeat(loader_micro_batch(batch, setup.data_format))
    weighting = weighting_for(setup.data_format, one_rank=True)  # one rank's step: no collective on fake tensors
    verdict = finite_verdict()
    # a GPU's autocast computes some ops in fp32 that the CPU's keeps in the lower precision: trace as it would
    policy = (cuda_autocast_policy() if setup.device_type == "cuda" and setup.compute_dtype is not None
              else nullcontext())
    try:
        with policy, tracker:
            tracker.mark(params, "parameters")
            tracker.mark(state, "optimizer")
            tracker.mark(batch.values(), "activations")
            accumulate_gradients(model, micro_batches, setup.grad_accum, sync_switch(model), autocast, weighting,
                                 MicroStep(phase=TracedPhases(tracker)))
            tracker.phase = "optimizer"
            clip_gradients(model, setup.grad_clip, "torch")  # torch's kernels: Triton's cannot run on fake tensors
            apply_update(optimizer, verdict)
    finally:
        for hook in hooks:
            hook.remove()
    return tracker, tracker.flash_calls


def training_model(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """The model as a run trains it, built from ``model.*`` on the current default device (``meta`` for a trace):
    a pretrained base in ``model.dtype``, checkpointing and LoRA adapters as configured.

    A pretrained model is planned from the shape in ``model.*``. An NF4 base is built by ``fake_model_state``
    (its 4-bit weights exist on fake tensors only).
    """
    base = replace(cfg, quantize=Quantize.none)
    model = pretrained_shape(base, vocab_size)
    if cfg.lora.enabled:  # peft's k-bit preparation freezes the base; a plain LoRA base is frozen by get_peft_model
        model.requires_grad_(False)
    return prepare_for_finetuning(model, base)


def pretrained_shape(cfg: ModelConfig, vocab_size: int) -> PreTrainedModel:
    """The model ``model.*`` describes, initialised as from scratch; a pretrained base in ``model.dtype``."""
    model = with_named_loss(AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, None),
                                                             attn_implementation="sdpa"))
    if cfg.pretrained is not None:
        model.to(DTYPES[cfg.dtype])
    return model


def fake_training_state(
    cfg: Config, vocab_size: int, micro_batch: int, device_type: str, mode: FakeTensorMode,
    param_dtype: torch.dtype | None = None, representative_chunks: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Model, AdamW with its state, and one micro batch of ``micro_batch`` rows, all fake (``fake_model_state``,
    then ``fake_batch``)."""
    model, optimizer = fake_model_state(cfg, vocab_size, device_type, mode, param_dtype, representative_chunks)
    return model, optimizer, fake_batch(cfg.data, micro_batch, mode)


def fake_model_state(
    cfg: Config, vocab_size: int, device_type: str, mode: FakeTensorMode, param_dtype: torch.dtype | None = None,
    representative_chunks: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Model and AdamW with its state, fake: built on ``meta``, then given fake storage. Any micro batch can run
    on them (``fake_batch``), and again after a traced step: the step clears the gradients it made and changes
    no shape (``Tracer`` traces every micro batch of a mode and depth on one such state).

    The optimizer takes the implementation the run would use on ``device_type`` (fused and foreach differ by a
    parameter-sized temporary). ``param_dtype``: compute on parameters of that dtype, as FSDP2's gathered
    working copy under a mixed-precision policy. An NF4 base (``model.quantize=nf4``) is built as the 4-bit load
    builds it, quantized on fake tensors, then prepared (k-bit preparation, LoRA) as a run prepares it.
    Packed blocks (``data.format=packed``) run their attention as the run does (``use_causal_attention``: SDPA,
    causal, no mask). ``representative_chunks``: the chunked loss runs its first two chunks and its last
    (``representative_chunk_starts``: the same peak, fewer ops).
    """
    nf4 = cfg.model.quantize == Quantize.nf4
    if nf4:
        from ddptrain.plan.memory.nf4 import convert_to_4bit_layers, quantize_4bit_layers
    with torch.device("meta"):
        if nf4:
            model = pretrained_shape(cfg.model, vocab_size)
            convert_to_4bit_layers(model)
            model = prepare_for_finetuning(model, cfg.model)
        else:
            model = training_model(cfg.model, vocab_size)
        if param_dtype is not None:
            model.to(param_dtype)
        if cfg.data.format == DataFormat.packed:  # one causal sequence per row, as the run's build says
            use_causal_attention(causal_lm_of(model))
        if cfg.train.chunked_loss:
            starts = representative_chunk_starts if representative_chunks else ALL_CHUNK_STARTS
            use_chunked_loss(model, cfg.train.loss_chunk_tokens, device_type, starts)
    with mode:
        model.to_empty(device="cpu")
        model.tie_weights()
        if nf4:
            quantize_4bit_layers(model, cfg.model)
        model.train()
        kwargs = impl_kwargs(cfg.optim.impl, torch.device(device_type))
        optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=cfg.optim.lr,
                                      **kwargs)
        create_optimizer_state(optimizer, model.parameters())
    if cfg.data.format == DataFormat.prompt_completion:  # the mask the run builds from a micro batch's inputs
        ready_attention_masks(model)
    return model, optimizer


def fake_batch(data: DataConfig, micro_batch: int, mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    """One fake micro batch of ``micro_batch`` full rows of ``data.seq_len`` tokens, as the model takes it."""
    with mode:
        ids = torch.zeros(micro_batch, data.seq_len, dtype=torch.long)
        return {"input_ids": ids, "labels": ids, **prompt_completion_inputs(data, ids)}


def prompt_completion_inputs(data: DataConfig, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a prompt/completion micro batch hands the model beside its tokens, from which the ready attention
    mask the run installs (``ready_attention_masks``, SDPA: one additive ``[rows, 1, T, T]`` mask per micro batch,
    which backward keeps) is built: packed rows' ``position_ids``, padded rows' padding mask. Planned at full
    rows of ``data.seq_len``; the mask's size, not its pattern, is what memory sees (one segment per row stands
    for any packing)."""
    if data.format != DataFormat.prompt_completion:
        return {}
    if data.packing:
        return {"position_ids": torch.arange(ids.shape[1]).expand_as(ids)}
    return {"attention_mask": torch.ones_like(ids)}
