"""Live tensor storage by category, op by op, and the highest point: the tracker the memory plan traces a step
with (on fake tensors, ``plan/memory/trace.py``) and a run on CPU measures its own steady step with
(``telemetry/measured_peak.py``).

``PeakTracker`` follows each tensor storage from the op that creates it to the moment it is freed, sums the live
bytes by category and keeps the category split at the global peak. An NF4 base's matmuls run as bitsandbytes'
kernel composes them (``telemetry/nf4_kernels.py``), so that the dequantized weight it holds is seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode  # torch documents dispatch modes at this path
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ddptrain.optim import local_optimizer

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
# A fake tensor's device query: it allocates nothing, and the tracker sees two of them for every op it tracks (the
# autograd engine and ``_group_tensors_by_device_and_dtype`` ask it of every tensor they handle; a real tensor never
# dispatches it). Answered here as the fake tensor answers it outside its kernels (``FakeTensor.__torch_dispatch__``),
# not passed through the fake mode's dispatch and the tracker's bookkeeping: a traced step's CPU falls by about a
# sixth, its bytes the same (docs/benchmarks.md; tests/test_memory_trace.py).
DEVICE = torch.ops.prim.device.default


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
        if func is DEVICE and isinstance(args[0], FakeTensor) and not args[0].fake_mode.in_kernel_invocation:
            return args[0].fake_device
        composed = self.compositions.get(func)
        if composed is not None:
            with self:  # the composition's ops come back through this mode, one by one
                return composed(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in FLASH_OPS:
            self.flash_calls += 1
        if func is CAST and self._category_of(args[0]) == "parameters":
            self.track(out, "parameter copies")
        if isinstance(out, torch.Tensor):  # most ops: one tensor, tracked without pytree's flatten and rebuild
            self.track(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf)
        self._observe()
        return out


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
    from ddptrain.telemetry.nf4_kernels import kernel_compositions

    return PeakTracker(kernel_compositions(device_type), vocab_size=vocab)
