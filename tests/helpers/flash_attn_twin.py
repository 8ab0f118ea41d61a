"""A CPU twin of the ``flash_attn`` package, so that transformers' own FlashAttention-2 integration runs here.

What it emulates: the two entry points transformers' lazy import resolves for ``flash_attention_2``
(``from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache`` and
``from flash_attn.bert_padding import pad_input, unpad_input``), with flash-attn 2's signatures (transformers
inspects them to decide which keyword arguments to pass), its layouts (``[batch, seq, heads, dim]`` for the dense
kernel, ``[tokens, heads, dim]`` plus int32 ``cu_seqlens`` and Python-int ``max_seqlen`` for varlen) and its
refusals: anything but fp16/bf16 ("FlashAttention only support fp16 and bf16 data type"), ``cu_seqlens`` not
int32; a ``max_seqlen`` given as a tensor is read back to an int, as the kernel's launch does. Each call computes
SDPA in the inputs' dtype: the dense kernel per row (causal or not), the varlen kernel within each ``cu_seqlens``
segment (a block-diagonal mask, built on the device from ``cu_seqlens`` without reading it back, as the real
kernel does not read it back either).

What it does not emulate: the real kernel's numerics (tiling, its own softmax rescaling and rounding), its memory
(no T x T matrix) and its speed; sliding windows, softcap and ALiBi are refused rather than imitated.

``install`` makes the environment look like an H100 user's with ``flash-attn`` installed: the twin under
``sys.modules["flash_attn"]``, transformers' availability checks true, and ddptrain's flash device set
including the CPU (the one place ddptrain's choice of kernel depends on the device).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

REFUSAL = "FlashAttention only support fp16 and bf16 data type"


@dataclass
class Calls:
    """What the twin was asked: dense calls (per row) and varlen calls with their cu_seqlens and max lengths."""

    dense: int = 0
    varlen: int = 0
    rows: list[int] = field(default_factory=list)  # batch size of each dense call
    # (cu_seqlens, max_seqlen) of each varlen call, as passed: an int, or a tensor the launch reads back
    segments: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def reset(self) -> None:
        self.dense = self.varlen = 0
        self.rows.clear()
        self.segments.clear()


CALLS = Calls()


def _refuse_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: tuple[int, int],
                        softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(REFUSAL)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if tuple(window_size) != (-1, -1) or softcap != 0.0 or alibi_slopes is not None:
        raise NotImplementedError("the flash-attn twin has no sliding window, softcap or ALiBi")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          dropout_p: float, scale: float | None) -> torch.Tensor:
    """SDPA on ``[batch, seq, heads, dim]`` inputs (grouped-query heads allowed), returned in that layout."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> torch.Tensor:
    """flash-attn 2's dense kernel: every row attends within itself (causally when asked)."""
    _refuse_unsupported(q, k, v, window_size, softcap, alibi_slopes)
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError("the flash-attn twin aligns causal masks only for equal query and key lengths")
    CALLS.dense += 1
    CALLS.rows.append(q.shape[0])
    return _sdpa(q, k, v, None, causal, dropout_p, softmax_scale)


def _segment_of(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's segment index, on the device (no read back)."""
    tokens = torch.arange(n, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn 2's varlen kernel: ``[tokens, heads, dim]``; each ``cu_seqlens`` segment attends within itself
    (causal masks aligned bottom-right, as flash-attn >= 2.1 does)."""
    _refuse_unsupported(q, k, v, window_size, softcap, alibi_slopes)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
        if cu.device != q.device:
            raise RuntimeError(f"{name} must be on the device of q")
    if block_table is not None:
        raise NotImplementedError("the flash-attn twin has no paged KV cache")
    CALLS.varlen += 1
    CALLS.segments.append((cu_seqlens_q, max_seqlen_q))
    # The kernel's launch takes the maximum lengths as ints: a device tensor (what transformers infers from
    # position_ids) is read back here, in every layer, as the real binding reads it.
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    seg_q, seg_k = _segment_of(cu_seqlens_q, q.shape[0]), _segment_of(cu_seqlens_k, k.shape[0])
    mask = seg_q[:, None] == seg_k[None, :]
    if causal:  # bottom-right: query i of a segment of lq sees keys j <= i + (lk - lq)
        pos_q = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[seg_q]
        pos_k = torch.arange(k.shape[0], device=k.device) - cu_seqlens_k[seg_k]
        shift = (cu_seqlens_k.diff() - cu_seqlens_q.diff())[seg_q]
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    return _sdpa(q[None], k[None], v[None], mask, False, dropout_p, softmax_scale)[0]


class Patcher(Protocol):
    """What ``install`` needs: pytest's ``MonkeyPatch`` (undone after the test) or ``Permanent``."""

    def setattr(self, target: Any, name: str, value: Any) -> None: ...

    def setitem(self, mapping: Any, name: Any, value: Any) -> None: ...


class Permanent:
    """Patches for a whole process (the CLI wrapper): nothing to undo."""

    def setattr(self, target: Any, name: str, value: Any) -> None:
        setattr(target, name, value)

    def setitem(self, mapping: Any, name: Any, value: Any) -> None:
        mapping[name] = value


def _package() -> tuple[types.ModuleType, types.ModuleType]:
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    package = types.ModuleType("flash_attn")
    package.__version__ = "2.8.3"  # type: ignore[attr-defined]
    package.__path__ = []  # type: ignore[attr-defined]  # a package: ``flash_attn.bert_padding`` imports from it
    package.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    package.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    package.flash_attn_with_kvcache = None  # type: ignore[attr-defined]  # inference only: not emulated
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = _pad_input, _unpad_input  # type: ignore[attr-defined]
    package.bert_padding = padding  # type: ignore[attr-defined]
    return package, padding


def install(patch: Patcher) -> Calls:
    """Make ``attn_implementation="flash_attention_2"`` resolve to the twin on this CPU, as on an H100 with
    ``flash-attn`` installed; returns the call record (reset)."""
    import transformers.modeling_flash_attention_utils as fa_utils

    import ddptrain.models.attention as attention

    package, padding = _package()
    patch.setitem(sys.modules, "flash_attn", package)
    patch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    available: Callable[..., bool] = lambda *args, **kwargs: True  # noqa: E731
    patch.setattr(fa_utils, "is_flash_attn_2_available", available)
    matrix = dict(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2])
    matrix.update(general_availability_check=available, pkg_availability_check=available,
                  supported_devices=((available, "cuda"),))
    patch.setitem(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX, 2, matrix)
    patch.setattr(fa_utils, "_loaded_implementation", None)  # transformers caches what it imported last
    patch.setattr(attention, "is_flash_attn_2_available", available)
    patch.setattr(attention, "FLASH_ATTENTION_DEVICES", attention.FLASH_ATTENTION_DEVICES | {"cpu"})
    CALLS.reset()
    return CALLS
