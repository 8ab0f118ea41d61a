"""Attention for training batches: causal SDPA without a mask for pretraining blocks; for packed prompt/completion
rows, FlashAttention-2's varlen kernel where it serves, else SDPA with a block-diagonal causal mask built on the
device; for padded prompt/completion rows, SDPA with a causal-and-padding mask built the same way.

Training forwards run without a KV cache (``use_cache=False``). Without a cache and without a padding mask,
transformers' mask builder (``create_causal_mask``) first looks for several sequences packed into one row
(``find_packed_sequence_indices``) and branches on the answer on the host: a device-to-host read in every
forward, a stall on a GPU. A packed block is one causal sequence per row and needs no mask. transformers skips
mask building for an attention function registered without a mask function (as for external backends), so
its own SDPA attention registered under a second name runs with ``attn_mask=None, is_causal=True``: the same
result, no host read, and SDPA's fused causal kernels. The name is not saved with the model (``save_pretrained``
writes no attention implementation).

Packed prompt/completion rows hold several examples each. FlashAttention-2 (CUDA with compute capability 8.0 or
newer, ``flash-attn`` installed, the attention computed in bf16 or fp16) runs its varlen kernel from the
``cu_seq_lens``/``max_length`` arguments the collate computed on the host (``data/packing.py``), for any number of
rows. SDPA gets a ready 4-D block-diagonal causal mask, built on the device from the restarting ``position_ids``
by a forward pre-hook: transformers takes a 4-D mask as it is, so its packed-sequence detection and the host read
it costs are skipped (the mask is the one it would have built). Either way the start-up check
(``packed_attention.py``) measures that examples stay apart.

The ready mask is additive (0 where a query may look, the dtype's lowest value where not) and in the dtype the
attention computes in (autocast's, else the model's), built once per forward and handed to every layer. A bool
mask, or a float one in another dtype, is converted inside every SDPA call, and SDPA's backward saves what it was
given: one ``[rows, 1, T, T]`` tensor per layer (36 layers of Qwen3-4B at 8 rows of 2048: 2.25 GiB) instead of one
per micro batch. Padded prompt/completion batches get the same: their 2-D padding mask becomes the one ready 4-D
mask (causal, padding keys hidden), which also skips the host read transformers' SDPA path makes to see whether a
batch has any padding. The mask's rows are laid out with a stride of a multiple of 8 elements: CUDA's
memory-efficient kernel copies a mask whose strides are not, in every call. The masks are built with
``unsqueeze``, ``narrow`` and ``logical_not`` rather than Python indexing and ``~``, which a CPU-only torch
refuses on a fake CUDA tensor: the tests build the CUDA forward's mask from FakeTensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

from ddptrain.config.choices import Precision

log = logging.getLogger(__name__)

CAUSAL_SDPA = "ddptrain_causal_sdpa"
FLASH_ATTENTION_DEVICES = frozenset({"cuda"})  # device types flash-attn's kernels run on
HALF = (torch.float16, torch.bfloat16)


def use_causal_attention(model: PreTrainedModel) -> None:
    """Run ``model``'s attention as SDPA with ``is_causal=True`` and no mask (packed blocks only)."""
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(CAUSAL_SDPA)


def use_varlen_attention(model: PreTrainedModel, device: torch.device, precision: Precision) -> bool:
    """Packed prompt/completion rows: FlashAttention-2's varlen kernels on a device that has them (CUDA with
    ``flash_attn`` installed, compute capability 8.0 or newer) when the attention computes in half precision
    (bf16/fp16 autocast, or half weights): flash-attn refuses fp32 and GPUs before Ampere, so either keeps ``sdpa``,
    with one line saying so. True when switched."""
    if device.type not in FLASH_ATTENTION_DEVICES or not is_flash_attn_2_available():
        return False
    if (refusal := flash_attention_refuses(device)) is not None:
        log.warning("data.packing: %s: packed rows use sdpa with a block-diagonal mask", refusal)
        return False
    if precision not in (Precision.bf16, Precision.fp16) and model.dtype not in HALF:
        log.warning("data.packing: FlashAttention-2 computes in bf16/fp16 only and this run is fp32 "
                    "(train.precision=%s, %s weights): packed rows use sdpa with a block-diagonal mask", precision,
                    str(model.dtype).removeprefix("torch."))
        return False
    model.set_attn_implementation("flash_attention_2")
    log.info("data.packing: FlashAttention-2 varlen kernels for the packed rows")
    return True


def flash_attention_refuses(device: torch.device) -> str | None:
    """Why flash-attn's kernels would refuse this CUDA device, or None. FlashAttention-2 runs on compute
    capability 8.0 and newer (Ampere on); below that (T4 7.5, V100 7.0) the package installs but its first call
    stops the run ("FlashAttention only supports Ampere GPUs or newer"), and transformers' own availability check
    does not ask. Only a CUDA device has a capability to read."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 0):
        return None
    name = torch.cuda.get_device_name(device)
    return (f"FlashAttention-2 needs compute capability 8.0 or newer; this GPU ({name}) has compute capability "
            f"{major}.{minor}")


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, T, T]`` bool: a token sees the tokens before it in its own segment, a segment starting wherever
    positions do not go up by one (transformers' own rule), computed on the device without a read back."""
    step = torch.diff(position_ids, prepend=position_ids.narrow(-1, 0, 1) - 1, dim=-1)
    segment = (step != 1).cumsum(-1)
    index = torch.arange(position_ids.shape[-1], device=position_ids.device)
    causal = index.unsqueeze(0) <= index.unsqueeze(1)
    return ((segment.unsqueeze(2) == segment.unsqueeze(1)) & causal).unsqueeze(1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (bool ``[rows, 1, T, T]``) as an additive mask in ``dtype``: 0 where a query may attend, the
    dtype's lowest value where not (a row with nothing allowed then averages instead of giving NaN). Each row of
    the storage is padded to a multiple of 8 elements, the alignment CUDA's memory-efficient kernel needs to take
    the mask as it is."""
    rows, heads, length, keys = allowed.shape
    width = -(-keys // 8) * 8
    mask = torch.zeros((rows, heads, length, width), dtype=dtype, device=allowed.device).narrow(-1, 0, keys)
    return mask.masked_fill_(allowed.logical_not(), torch.finfo(dtype).min)


def padding_causal_mask(padding: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, T, T]`` bool from a 2-D padding mask (1 for a real token): a token sees the real tokens up to it
    (transformers' own causal-and-padding mask for SDPA)."""
    index = torch.arange(padding.shape[-1], device=padding.device)
    causal = index.unsqueeze(0) <= index.unsqueeze(1)
    return (causal.unsqueeze(0) & padding.bool().unsqueeze(1)).unsqueeze(1)


def _attention_dtype(module: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype attention computes in: autocast's where it is on (SDPA is on its lower-precision list, and casts a
    mask of another dtype in every call), else the model's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return getattr(module, "dtype", torch.float32)


def _with_ready_mask(module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    positions, padding = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if padding is None and positions is not None:  # packed rows: segments where positions restart
        allowed = block_causal_mask(positions)
    elif padding is not None and padding.dim() == 2:  # padded rows
        allowed = padding_causal_mask(padding)
    else:
        return None
    return args, {**kwargs, "attention_mask": additive_mask(allowed, _attention_dtype(module, allowed.device))}


def ready_attention_masks(model: torch.nn.Module) -> bool:
    """SDPA on prompt/completion batches: hand every forward one ready additive 4-D mask, built on the device once
    and shared by every layer: block-diagonal causal for packed rows (no per-forward host read in transformers'
    detection), causal with padding hidden for padded ones. Only for ``sdpa``: FlashAttention takes the varlen
    arguments or unpads, and eager attention builds its additive mask once and saves none for backward, so both
    keep transformers' own path. Installed on the model as the run calls it (after adapter wrapping; peft forwards
    the keyword arguments). True when installed."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.register_forward_pre_hook(_with_ready_mask, with_kwargs=True)
    return True
