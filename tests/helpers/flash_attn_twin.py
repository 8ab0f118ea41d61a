"""A CPU twin of the ``flash_attn`` package (2.8), so that transformers' own FlashAttention-2 integration runs here.

How flash-attn 2.8 is built, and the twin with it: its four kernels are ``torch.library`` custom ops with fake
(meta) implementations, ``flash_attn::_flash_attn_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_forward`` and ``_flash_attn_varlen_backward``, with the real ops' schemas (arguments, return
values, the backward ops writing ``dq``/``dk``/``dv`` in place). Python entry points (``flash_attn_func``,
``flash_attn_varlen_func``, with flash-attn's signatures: transformers inspects them) call them from
``torch.autograd.Function``s that pad the head dimension to a multiple of 8, save q, k, v, the output, the
log-sum-exp and the RNG state, and call the backward op. So Dynamo traces one opaque op per call (through the fake
implementation), selective checkpointing's op policy and any ``TorchDispatchMode`` see the op by its real name, and
nothing inside the kernel is traced or recorded op by op, as on a GPU.

What each kernel refuses, as flash-attn's C++ checks do: a device below compute capability 8.0 ("FlashAttention only
supports Ampere GPUs or newer."); anything but fp16/bf16 ("FlashAttention only support fp16 and bf16 data type");
q, k, v of different dtypes; a head dimension above 256; key/value heads that do not divide the query heads;
``cu_seqlens`` that are not int32, not contiguous, not on q's device, or not of one entry per sequence plus one.
And what the real kernel trusts and the twin checks, so that a test catches a caller's mistake the GPU would turn
into silently wrong numbers or out-of-bounds reads: ``cu_seqlens`` that do not start at 0 or go down, a last offset
that is not the token count, a ``max_seqlen`` below the longest segment. Sliding windows, softcap, ALiBi, attention
probabilities and the paged KV cache are refused rather than imitated.

The compute capability is what ``torch.cuda.get_device_capability()`` answers where it answers (a GPU, or a test
that fakes ``torch.cuda``); on this CPU-only torch it cannot, and the twin stands in for an H100 (sm_90).

What the kernels compute: SDPA in the inputs' dtype, the dense kernel per row, the varlen kernel within each
``cu_seqlens`` segment (causal masks aligned bottom-right, as flash-attn >= 2.1 does), with dropout drawn from a
seed kept in the returned RNG state, so that the backward kernel (SDPA's own gradients, recomputed) replays it; the
log-sum-exp in fp32. Not the real kernel's numerics (tiling, online softmax, rounding), memory or speed.

What the twin records (``Calls``) is counted inside the kernels, which run at execution time in eager and compiled
code alike and are never traced: a counter in the traced Python would be a constant Dynamo guards on, one recompile
per call. A maximum length given as a tensor is read back to an int before the launch (torch's argument parsing of
the real op's ``int`` does the same, a device-to-host read); the twin does it in Python, where a test sees it.

``install`` makes the environment look like an H100 user's with ``flash-attn`` installed: the twin under
``sys.modules["flash_attn"]``, transformers' availability checks true, and ddptrain's flash device set including
the CPU (the one place ddptrain's choice of kernel depends on the device). The ops are registered when this module
is imported (once per process: a process that imported the real flash-attn cannot import the twin too).
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

REFUSAL = "FlashAttention only support fp16 and bf16 data type"
PRE_AMPERE = "FlashAttention only supports Ampere GPUs or newer."
MAX_HEAD_DIM = 256
H100 = (9, 0)  # the device the twin stands in for where torch.cuda cannot answer


@dataclass
class Calls:
    """What the kernels were asked: dense calls (rows of each), varlen calls (cu_seqlens and maximum length of
    each, as the kernel took them), backward kernel calls, and maximum lengths that were tensors read back."""

    dense: int = 0
    varlen: int = 0
    backward: int = 0
    read_back: int = 0
    rows: list[int] = field(default_factory=list)
    segments: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def reset(self) -> None:
        self.dense = self.varlen = self.backward = self.read_back = 0
        self.rows.clear()
        self.segments.clear()


CALLS = Calls()


def device_capability() -> tuple[int, int]:
    """The compute capability flash-attn's kernels check: torch.cuda's answer, or an H100's where a CPU-only
    torch cannot give one."""
    try:
        major, minor = torch.cuda.get_device_capability()
    except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled"
        return H100
    return major, minor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- the kernels' checks ---------------------------------------------------------------------------------------

def _refuse_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size_left: int, window_size_right: int,
                   softcap: float, alibi_slopes: torch.Tensor | None, return_softmax: bool = False) -> None:
    if device_capability()[0] < 8:
        raise RuntimeError(PRE_AMPERE)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(REFUSAL)
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if head_dim % 8:
        raise RuntimeError("query, key, value, and out_ must have a head_size that is a multiple of 8")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if (window_size_left, window_size_right) != (-1, -1) or softcap != 0.0 or alibi_slopes is not None:
        raise NotImplementedError("the flash-attn twin has no sliding window, softcap or ALiBi")
    if return_softmax:
        raise NotImplementedError("the flash-attn twin returns no attention probabilities")


def _refuse_offsets(name: str, cu: torch.Tensor, q: torch.Tensor, sequences: int, tokens: int,
                    max_seqlen: int) -> None:
    """flash-attn's checks of ``cu_seqlens`` (dtype, device, layout, length), then what the kernel trusts."""
    if cu.dtype != torch.int32:
        raise RuntimeError(f"{name} must have dtype int32")
    if cu.device != q.device:
        raise RuntimeError(f"{name} must be on the device of q")
    if not cu.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")
    if cu.shape != (sequences + 1,):
        raise RuntimeError(f"{name} must have shape (batch_size + 1)")
    offsets = cu.tolist()  # the twin reads them (the real kernel never does: it trusts them)
    if offsets[0] != 0 or any(b < a for a, b in itertools.pairwise(offsets)):
        raise RuntimeError(f"{name} must start at 0 and never go down: {offsets} (the real kernel would read out "
                           "of its sequences)")
    if offsets[-1] != tokens:
        raise RuntimeError(f"{name} ends at {offsets[-1]}, not at the {tokens} tokens given (the real kernel would "
                           "leave tokens out or read past them)")
    longest = max(b - a for a, b in itertools.pairwise(offsets))
    if max_seqlen < longest:
        raise RuntimeError(f"max_seqlen {max_seqlen} is below the longest segment of {name} ({longest}): the real "
                           "kernel silently computes wrong results")


# ---- what the kernels compute ----------------------------------------------------------------------------------

def _segment_of(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's segment index."""
    tokens = torch.arange(n, device=cu_seqlens.device, dtype=torch.int32)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)


def _varlen_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, nq: int, nk: int, causal: bool) -> torch.Tensor:
    """``[nq, nk]`` bool: a query sees the keys of its own segment (causally: query i of a segment of lq sees keys
    j <= i + (lk - lq), bottom-right aligned)."""
    seg_q, seg_k = _segment_of(cu_q, nq), _segment_of(cu_k, nk)
    mask = seg_q[:, None] == seg_k[None, :]
    if causal:
        pos_q = torch.arange(nq, device=cu_q.device) - cu_q[seg_q]
        pos_k = torch.arange(nk, device=cu_k.device) - cu_k[seg_k]
        shift = (cu_k.diff() - cu_q.diff())[seg_q]
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    return mask


def _dense_mask(sq: int, sk: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    if not causal:
        return None
    return torch.arange(sk, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + (sk - sq)


def _probabilities(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities ``[batch, heads, seq_q, seq_k]`` and log-sum-exp ``[batch, heads, seq_q]`` in fp32 (the
    kernel accumulates in fp32). Grouped-query heads: query head h reads key/value head h // (heads / kv heads). A
    query that sees no key gets no probability (and a log-sum-exp of -inf)."""
    keys = k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0), lse


def _dropout_scale(shape: torch.Size, dropout_p: float, seed: int, device: torch.device) -> torch.Tensor | None:
    """Dropout's factor per probability (0, or 1 / (1 - p) where kept): the same for the same seed."""
    if dropout_p == 0:
        return None
    keep = torch.rand(shape, generator=torch.Generator(device).manual_seed(seed), device=device) >= dropout_p
    return keep / (1 - dropout_p)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
            scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention on ``[batch, seq, heads, dim]``: the output and the log-sum-exp, in fp32."""
    probs, lse = _probabilities(q, k, mask, scale)
    dropout = _dropout_scale(probs.shape, dropout_p, seed, q.device)
    values = v.float().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", probs if dropout is None else probs * dropout, values)
    return out, lse


def _gradients(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               dropout_p: float, scale: float, seed: int) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of ``_attend`` (the same dropout, from the same seed), by the softmax's backward in fp32. Autograd
    does not record inside a custom op's kernel (the kernel runs below the autograd dispatch key), so the twin
    differentiates by hand, as the real backward kernel does."""
    groups = q.shape[2] // k.shape[2]
    keys, values = (t.float().repeat_interleave(groups, dim=2) for t in (k, v))
    probs, _ = _probabilities(q, k, mask, scale)
    dropout = _dropout_scale(probs.shape, dropout_p, seed, q.device)
    grad_out = dout.float()
    grad_values = torch.einsum("bhqk,bqhd->bkhd", probs if dropout is None else probs * dropout, grad_out)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", grad_out, values)
    if dropout is not None:
        grad_probs = grad_probs * dropout
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
    grad_q = torch.einsum("bhqk,bkhd->bqhd", grad_scores, keys) * scale
    grad_keys = torch.einsum("bhqk,bqhd->bkhd", grad_scores, q.float()) * scale

    def per_kv_head(grad: torch.Tensor) -> torch.Tensor:  # the query heads of a group share one key/value head
        return grad.unflatten(2, (k.shape[2], groups)).sum(3)

    return grad_q, per_kv_head(grad_keys), per_kv_head(grad_values)


def _like(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The output as the kernel allocates it, ``empty_like(q)`` (q's dtype and strides), which is what the fake
    implementation promises: a compiled graph plans its views on those strides."""
    return torch.empty_like(q).copy_(out)


def _new_seed(dropout_p: float) -> int:
    return int(torch.randint(0, 2**62, ())) if dropout_p > 0 else 0


def _rng_state(seed: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([seed, 0], dtype=torch.int64, device=like.device)


# ---- the four ops, under flash-attn's names and schemas --------------------------------------------------------

@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cpu")
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_inputs(q, k, v, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
    CALLS.dense += 1
    CALLS.rows.append(q.shape[0])
    mask = _dense_mask(q.shape[1], k.shape[1], causal, q.device)
    seed = _new_seed(dropout_p)
    out, lse = _attend(q, k, v, mask, dropout_p, softmax_scale, seed)
    return _like(q, out), lse, q.new_empty(0), _rng_state(seed, q)


@_flash_attn_forward.register_fake
def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left,  # type: ignore[no-untyped-def]
                             window_size_right, softcap, alibi_slopes, return_softmax):
    batch, seq_q, heads, _ = q.shape
    lse = q.new_empty((batch, heads, seq_q), dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                               block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                               seqused_k: torch.Tensor | None = None, zero_tensors: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_inputs(q, k, v, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise NotImplementedError("the flash-attn twin has no paged or left-padded KV cache")
    sequences = cu_seqlens_q.numel() - 1
    _refuse_offsets("cu_seqlens_q", cu_seqlens_q, q, sequences, q.shape[0], max_seqlen_q)
    _refuse_offsets("cu_seqlens_k", cu_seqlens_k, q, sequences, k.shape[0], max_seqlen_k)
    CALLS.varlen += 1
    CALLS.segments.append((cu_seqlens_q, max_seqlen_q))
    mask = _varlen_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal)
    seed = _new_seed(dropout_p)
    out, lse = _attend(q[None], k[None], v[None], mask, dropout_p, softmax_scale, seed)
    return _like(q, out[0]), lse[0].contiguous(), q.new_empty(0), _rng_state(seed, q)


@_flash_attn_varlen_forward.register_fake
def _flash_attn_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,  # type: ignore[no-untyped-def]
                                    max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                    window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
                                    block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    tokens, heads, _ = q.shape
    lse = q.new_empty((heads, tokens), dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                         dv: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: torch.Tensor | None, deterministic: bool,
                         rng_state: torch.Tensor | None = None) -> torch.Tensor:
    _refuse_inputs(q, k, v, window_size_left, window_size_right, softcap, alibi_slopes)
    assert dq is not None and dk is not None and dv is not None, "the twin writes into the caller's dq, dk, dv"
    CALLS.backward += 1
    seed = int(rng_state[0]) if rng_state is not None else 0
    mask = _dense_mask(q.shape[1], k.shape[1], causal, q.device)
    for grad, into in zip(_gradients(dout, q, k, v, mask, dropout_p, softmax_scale, seed), (dq, dk, dv), strict=True):
        into.copy_(grad)
    batch, seq_q, heads, _ = q.shape
    softmax_d = dout.new_zeros((batch, heads, _round_up(seq_q, 128)), dtype=torch.float32)
    softmax_d[..., :seq_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,  # type: ignore[no-untyped-def]
                              softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                              deterministic, rng_state=None):
    batch, seq_q, heads, _ = q.shape
    return q.new_empty((batch, heads, _round_up(seq_q, 128)), dtype=torch.float32)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
                                dk: torch.Tensor | None, dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
                                rng_state: torch.Tensor | None = None, zero_tensors: bool = False) -> torch.Tensor:
    _refuse_inputs(q, k, v, window_size_left, window_size_right, softcap, alibi_slopes)
    assert dq is not None and dk is not None and dv is not None, "the twin writes into the caller's dq, dk, dv"
    sequences = cu_seqlens_q.numel() - 1
    _refuse_offsets("cu_seqlens_q", cu_seqlens_q, q, sequences, q.shape[0], max_seqlen_q)
    _refuse_offsets("cu_seqlens_k", cu_seqlens_k, q, sequences, k.shape[0], max_seqlen_k)
    CALLS.backward += 1
    seed = int(rng_state[0]) if rng_state is not None else 0
    mask = _varlen_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal)
    grads = _gradients(dout[None], q[None], k[None], v[None], mask, dropout_p, softmax_scale, seed)
    for grad, into in zip(grads, (dq, dk, dv), strict=True):
        into.copy_(grad[0])
    # the kernel's layout: sequence i's rows start at cu_seqlens_q[i] + 128 * i
    tokens, heads, _ = q.shape
    softmax_d = dout.new_zeros((heads, tokens + 128 * sequences), dtype=torch.float32)
    rows = torch.arange(tokens, device=q.device) + 128 * _segment_of(cu_seqlens_q, tokens)
    softmax_d[:, rows] = (dout.float() * out.float()).sum(-1).T
    return softmax_d


@_flash_attn_varlen_backward.register_fake
def _flash_attn_varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv,  # type: ignore[no-untyped-def]
                                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size_left, window_size_right, softcap,
                                     alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
    tokens, heads, _ = q.shape
    return q.new_empty((heads, tokens + 128 * (cu_seqlens_q.shape[0] - 1)), dtype=torch.float32)


# ---- the autograd functions and entry points flash-attn exports ------------------------------------------------

def _pad_head_dim(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels take head dimensions in multiples of 8: flash-attn pads before the op and slices after."""
    pad = -tensors[0].shape[-1] % 8
    return [F.pad(t, [0, pad]) if pad else t for t in tensors]


class FlashAttnFunc(torch.autograd.Function):
    """``[batch, seq, heads, dim]``: the dense forward op, its outputs saved for the dense backward op."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                softmax_scale: float | None, causal: bool, window_size: tuple[int, int], softcap: float,
                alibi_slopes: torch.Tensor | None, deterministic: bool, return_softmax: bool,
                is_grad_enabled: bool) -> torch.Tensor:
        head_dim = q.shape[-1]
        scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        q, k, v = _pad_head_dim(q, k, v)
        out, lse, _, rng_state = torch.ops.flash_attn._flash_attn_forward(
            q, k, v, dropout_p, scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
            return_softmax)
        if is_grad_enabled:
            ctx.save_for_backward(q, k, v, out, lse, rng_state)
            ctx.settings = (dropout_p, scale, causal, window_size, softcap, alibi_slopes, deterministic)
        return out[..., :head_dim]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *unused: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        dropout_p, scale, causal, window_size, softcap, alibi_slopes, deterministic = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_dim = dout.shape[-1]
        (dout_padded,) = _pad_head_dim(dout)
        torch.ops.flash_attn._flash_attn_backward(
            dout_padded, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, window_size[0], window_size[1],
            softcap, alibi_slopes, deterministic, rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *([None] * 9))


class FlashAttnVarlenFunc(torch.autograd.Function):
    """``[tokens, heads, dim]`` with ``cu_seqlens``: the varlen forward op, its outputs saved for the varlen
    backward op."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                softmax_scale: float | None, causal: bool, window_size: tuple[int, int], softcap: float,
                alibi_slopes: torch.Tensor | None, deterministic: bool, return_softmax: bool,
                block_table: torch.Tensor | None, is_grad_enabled: bool) -> torch.Tensor:
        head_dim = q.shape[-1]
        scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        q, k, v = _pad_head_dim(q, k, v)
        out, lse, _, rng_state = torch.ops.flash_attn._flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal,
            window_size_left=window_size[0], window_size_right=window_size[1], softcap=softcap,
            alibi_slopes=alibi_slopes, return_softmax=return_softmax, block_table=block_table)
        if is_grad_enabled:
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state)
            ctx.settings = (max_seqlen_q, max_seqlen_k, dropout_p, scale, causal, window_size, softcap,
                            alibi_slopes, deterministic)
        return out[..., :head_dim]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, *unused: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        max_q, max_k, dropout_p, scale, causal, window_size, softcap, alibi_slopes, deterministic = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_dim = dout.shape[-1]
        (dout_padded,) = _pad_head_dim(dout)
        torch.ops.flash_attn._flash_attn_varlen_backward(
            dout_padded, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, scale,
            causal, window_size[0], window_size[1], softcap, alibi_slopes, deterministic, rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *([None] * 14))


def _grad_wanted(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> torch.Tensor:
    """flash-attn 2's dense kernel: every row attends within itself (causally when asked)."""
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes,
                               deterministic, return_attn_probs, _grad_wanted(q, k, v))


def _int_length(n: int | torch.Tensor) -> int:
    """The op takes the maximum length as an int: a tensor is read back to the host here (counted)."""
    if isinstance(n, torch.Tensor):
        CALLS.read_back += 1
        return int(n)
    return n


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn 2's varlen kernel: ``[tokens, heads, dim]``; each ``cu_seqlens`` segment attends within itself."""
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, _int_length(max_seqlen_q),
                                     _int_length(max_seqlen_k), dropout_p, softmax_scale, causal, tuple(window_size),
                                     softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                                     _grad_wanted(q, k, v))


# ---- installing it ---------------------------------------------------------------------------------------------

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
