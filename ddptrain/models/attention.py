"""Attention for packed rows: causal SDPA without a mask for pretraining blocks; FlashAttention's varlen kernels
for packed prompt/completion rows on a GPU that has them.

Training forwards run without a KV cache (``use_cache=False``). Without a cache and without a padding mask,
transformers' mask builder (``create_causal_mask``) first looks for several sequences packed into one row
(``find_packed_sequence_indices``) and branches on the answer on the host: a device-to-host read in every
forward, a stall on a GPU. A packed block is one causal sequence per row and needs no mask. transformers skips
mask building for an attention function registered without a mask function (as for external backends), so
its own SDPA attention registered under a second name runs with ``attn_mask=None, is_causal=True``: the same
result, no host read, and SDPA's fused causal kernels. Padded prompt/completion batches keep ``sdpa`` with
their masks. The name is not saved with the model (``save_pretrained`` writes no attention implementation).
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

log = logging.getLogger(__name__)

CAUSAL_SDPA = "ddptrain_causal_sdpa"


def use_causal_attention(model: PreTrainedModel) -> None:
    """Run ``model``'s attention as SDPA with ``is_causal=True`` and no mask (packed blocks only)."""
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(CAUSAL_SDPA)


def use_varlen_attention(model: PreTrainedModel, device: torch.device) -> bool:
    """Packed prompt/completion rows: on CUDA with ``flash_attn`` installed, FlashAttention-2, whose varlen
    kernels attend within each example from the restarting ``position_ids`` (no T x T mask, no attention to
    padding); elsewhere ``sdpa`` with the block-diagonal mask transformers builds from them. Either way the
    start-up check (``packed_attention.py``) measures that examples stay apart. True when switched."""
    if device.type != "cuda" or not is_flash_attn_2_available():
        return False
    model.set_attn_implementation("flash_attention_2")
    log.info("data.packing: FlashAttention-2 varlen kernels for the packed rows")
    return True
