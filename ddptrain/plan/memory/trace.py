"""Peak memory of one training step, traced on fake tensors: what the step allocates, op by op, with no memory.

The model is built on ``meta`` and materialised as fake tensors (``FakeTensorMode``); one real step (forward,
backward, clipping, the optimizer update) then runs with every op's output shapes and dtypes but no data.
``PeakTracker`` follows each tensor storage from the op that creates it to the moment it is freed, sums the live
bytes by category and keeps the category split at the global peak. An NF4 base is held as bitsandbytes holds
it (``ddptrain/plan/memory/nf4.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode  # torch documents dispatch modes at this path
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AutoModelForCausalLM, PreTrainedModel

from ddptrain.config.choices import DataFormat, Quantize
from ddptrain.config.schema import Config, DataConfig, ModelConfig
from ddptrain.models import chunked_loss
from ddptrain.models.attention import ready_attention_masks, use_causal_attention
from ddptrain.models.build import hf_config
from ddptrain.models.chunked_loss import causal_lm_of, use_chunked_loss
from ddptrain.models.lora import DTYPES, prepare_for_finetuning
from ddptrain.optim import impl_kwargs, local_optimizer, param_groups

# Without a mask, SDPA runs a flash kernel on fake tensors too: the CPU's, whose forward saves what CUDA's flash
# kernel saves (the bf16 output and its fp32 log-sum-exp, not the attention matrix).
FLASH_OPS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default)
# "parameter copies": parameters cast to the compute dtype by autocast, kept for backward (FSDP2's gathered
# low-precision parameters take their place).
# "logits and loss": what the LM head and the cross-entropy create, told by the vocabulary as last dimension (the
# logits, their log-softmax and gradient; with train.chunked_loss one chunk's worth); counted apart from the other
# activations and temporaries so that the plan shows that share with and without chunking.
CATEGORIES = ("parameters", "parameter copies", "gradients", "optimizer", "activations", "temporaries",
              "logits and loss")
CAST = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class PeakMemory:
    """Bytes live at the step's peak, by category; ``peak`` is their sum."""

    peak: int
    by_category: dict[str, int]
    phase: str  # where the peak fell: forward, backward or optimizer


class PeakTracker(TorchDispatchMode):
    """Live bytes by category, op by op; the category split at the highest total.

    A storage created in forward counts as an activation, in backward or the optimizer step as a temporary,
    until ``mark`` files it under parameters, gradients or optimizer state. Views share their base's storage
    and count once. Only the global peak is kept (no per-module peaks), which keeps a step cheap to trace.
    """

    def __init__(self, compositions: Mapping[Any, Callable[..., Any]] | None = None,
                 vocab_size: int | None = None) -> None:
        """``compositions``: ops to run as their kernels compose them, so that their temporaries count (a fake
        kernel shows only its output). ``vocab_size``: new tensors of two or more dimensions with this last
        dimension count as "logits and loss"."""
        super().__init__()
        self.compositions = dict(compositions or {})
        self.vocab_size = vocab_size
        self.phase = "forward"
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = PeakMemory(0, dict(self.live), self.phase)
        self.phase_peaks: dict[str, PeakMemory] = {}  # the highest point of each phase
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.flash_calls = 0  # attention calls that ran a flash kernel (not the math path)

    def _new_category(self) -> str:
        return "activations" if self.phase.startswith("forward") else "temporaries"

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Count ``tensor``'s storage (once), as ``category`` or as the phase's default; refile it if counted."""
        storage = tensor.untyped_storage()
        entry = self._entries.get(storage)
        if entry is not None:
            if category is not None and entry[1] != category:
                self.live[entry[1]] -= entry[0]
                self.live[category] += entry[0]
                entry[1] = category
            return
        if category is None and self.vocab_size is not None and tensor.dim() >= 2 \
                and tensor.shape[-1] == self.vocab_size:
            category = "logits and loss"
        entry = [storage.nbytes(), category or self._new_category()]
        self._entries[storage] = entry
        self.live[entry[1]] += entry[0]
        self.total += entry[0]
        weakref.finalize(storage, self._free, entry)

    def _category_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._entries.get(tensor.untyped_storage())
        return None if entry is None else entry[1]

    def mark(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        for t in tensors:
            if t is not None:
                self.track(t, category)

    def _free(self, entry: list) -> None:
        self.live[entry[1]] -= entry[0]
        self.total -= entry[0]

    def _observe(self) -> None:
        phase_peak = self.phase_peaks.get(self.phase)
        if phase_peak is None or self.total > phase_peak.peak:
            self.phase_peaks[self.phase] = PeakMemory(self.total, dict(self.live), self.phase)
            if self.total > self.peak.peak:
                self.peak = self.phase_peaks[self.phase]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        composed = self.compositions.get(func)
        if composed is not None:
            with self:  # the composition's ops come back through this mode, one by one
                return composed(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in FLASH_OPS:
            self.flash_calls += 1
        if func is CAST and self._category_of(args[0]) == "parameters":
            self.track(out, "parameter copies")
        tree_map_only(torch.Tensor, self.track, out)
        self._observe()
        return out


@dataclass(frozen=True)
class StepSetup:
    """How the traced step runs: what the target device would run, not what this machine would."""

    device_type: str  # "cuda" or "cpu": the device whose AdamW implementation the step runs
    compute_dtype: torch.dtype | None  # autocast dtype; None: fp32
    grad_clip: float
    grad_accum: int = 1


def model_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    """(parameters, buffers and 4-bit quantization state, optimizer state) of a model and its optimizer."""
    params = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
    state = [v for s in local_optimizer(optimizer).state.values() for v in s.values() if torch.is_tensor(v)]
    return params, state


def quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What bitsandbytes keeps beside each 4-bit weight, outside parameters and buffers: the block scales (8-bit
    under double quantization), their own scales and offset, and the code tables."""
    tensors = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            tensors += [t for t in (state.absmax, state.code, state.offset) if torch.is_tensor(t)]
            state = state.state2
    return tensors


def step_tracker(model: torch.nn.Module, device_type: str) -> PeakTracker:
    """A tracker for a step of ``model`` on ``device_type``; a 4-bit model's matmuls run as bitsandbytes' kernel
    on that device composes them, dequantized weight included."""
    inner = getattr(model, "module", model)  # under torch DDP, the model it wraps
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None)
    if not any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
        return PeakTracker(vocab_size=vocab)
    from ddptrain.plan.memory.nf4 import kernel_compositions

    return PeakTracker(kernel_compositions(device_type), vocab_size=vocab)


def create_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
    """One update on zero gradients: the optimizer state exists before the traced step, as in any step but the
    first."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def gradient_sync(model: torch.nn.Module, sync: bool) -> AbstractContextManager:
    """Skip the gradient sync on accumulation micro batches, as the run does (DDP's no_sync; FSDP2 keeps the
    unsharded gradients until the last micro batch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    if isinstance(model, DistributedDataParallel) and not sync:
        return model.no_sync()
    return nullcontext()


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
    """One training step under ``PeakTracker``: forward (no KV cache), backward, clipping, the update.

    Works the same on fake and on real tensors (the validation runs both). Returns the tracker (the peak, and
    each phase's) and how many attention calls ran a flash kernel.
    """
    from ddptrain.kernels.clip import clip_grad_norm

    tracker = step_tracker(model, setup.device_type)
    params, state = model_state_tensors(model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.mark([p.grad], "gradients")) for p in trainable]
    autocast = (torch.autocast("cpu", dtype=setup.compute_dtype) if setup.compute_dtype is not None
                else nullcontext())
    try:
        with tracker:
            tracker.mark(params, "parameters")
            tracker.mark(state, "optimizer")
            tracker.mark(batch.values(), "activations")
            for micro in range(setup.grad_accum):
                later = " (accumulating)" if micro else ""  # later micro batches run beside the gradients
                with gradient_sync(model, micro == setup.grad_accum - 1):
                    tracker.phase = "forward" + later
                    with autocast:
                        loss = model(**batch, use_cache=False).loss / setup.grad_accum
                    tracker.phase = "backward" + later
                    loss.backward()
                    del loss
            tracker.phase = "optimizer"
            clip_grad_norm(model.parameters(), setup.grad_clip or None, "torch")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for hook in hooks:
            hook.remove()
    return tracker, tracker.flash_calls


def training_model(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """The model as a run trains it, built from ``model.*`` on the current default device (``meta`` for a trace):
    a pretrained base in ``model.dtype``, checkpointing and LoRA adapters as configured.

    A pretrained model is planned from the shape in ``model.*``. An NF4 base is built by ``fake_training_state``
    (its 4-bit weights exist on fake tensors only).
    """
    base = replace(cfg, quantize=Quantize.none)
    model = pretrained_shape(base, vocab_size)
    if cfg.lora.enabled:  # peft's k-bit preparation freezes the base; a plain LoRA base is frozen by get_peft_model
        model.requires_grad_(False)
    return prepare_for_finetuning(model, base)


def pretrained_shape(cfg: ModelConfig, vocab_size: int) -> PreTrainedModel:
    """The model ``model.*`` describes, initialised as from scratch; a pretrained base in ``model.dtype``."""
    model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, None), attn_implementation="sdpa")
    if cfg.pretrained is not None:
        model.to(DTYPES[cfg.dtype])
    return model


def fake_training_state(
    cfg: Config, vocab_size: int, micro_batch: int, device_type: str, mode: FakeTensorMode,
    param_dtype: torch.dtype | None = None, representative_chunks: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Model, AdamW with its state, and one micro batch, all fake: built on ``meta``, then given fake storage.

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
        ids = torch.zeros(micro_batch, cfg.data.seq_len, dtype=torch.long)
        attention = prompt_completion_inputs(model, cfg.data, ids)
    return model, optimizer, {"input_ids": ids, "labels": ids, **attention}


def prompt_completion_inputs(model: torch.nn.Module, data: DataConfig, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a prompt/completion micro batch hands the model beside its tokens, with the ready attention mask the
    run builds from it (SDPA: one additive ``[rows, 1, T, T]`` mask per micro batch, which backward keeps): packed
    rows' ``position_ids``, padded rows' padding mask. Planned at full rows of ``data.seq_len``; the mask's size,
    not its pattern, is what memory sees (one segment per row stands for any packing)."""
    if data.format != DataFormat.prompt_completion:
        return {}
    ready_attention_masks(model)
    if data.packing:
        return {"position_ids": torch.arange(ids.shape[1]).expand_as(ids)}
    return {"attention_mask": torch.ones_like(ids)}
