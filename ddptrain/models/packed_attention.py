"""Whether a model keeps packed examples apart: measured once on the model itself before training packs data.

transformers builds a block-diagonal causal mask from ``position_ids`` that restart at 0 (sdpa, eager, flex), we
hand SDPA that mask ready-made, or FlashAttention runs its varlen kernel from the collate's ``cu_seq_lens``; a
model (or attention implementation) that does none of these lets every example attend to the ones packed before
it, silently. The check packs examples as training does (the same collate, two rows of two, so a path taken only
by several rows is the one measured) and runs under the run's autocast (FlashAttention refuses fp32). It refuses
the model when an example's logits behind another move by a visible share of what an open (causal, unseparated)
row moves them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from ddptrain.data.packing import COUNTS, PackCollate, to_device
from ddptrain.errors import ConfigError

LEAK_SHARE = 0.05  # the packed logits may move by this share of an unseparated row's shift (bf16 rounding: <1%)


@torch.no_grad()
def leak_share(model: torch.nn.Module, vocab_size: int, length: int = 6,
               autocast: AbstractContextManager | None = None) -> float:
    """How far the second example of each of two packed rows moves, as a share of how far attending to the first
    moves it: ~0 when packed examples are kept apart, ~1 when they attend to each other."""
    device = next(p.device for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": ids, "labels": ids}
                for ids in torch.randint(0, vocab_size, (4, length), generator=g).tolist()]
    collate = PackCollate(pad_id=0, seq_len=2 * length)
    packed = collate(examples)  # equal lengths: rows [0, 1] and [2, 3]
    assert packed["input_ids"].shape == (2, 2 * length)
    joined = [{"input_ids": a["input_ids"] + b["input_ids"], "labels": a["labels"] + b["labels"]}
              for a, b in ((examples[0], examples[1]), (examples[2], examples[3]))]
    open_rows = collate(joined)  # the same tokens, one sequence per row: the second example sees the first
    was_training = model.training
    model.eval()
    try:
        def logits(batch: dict) -> torch.Tensor:
            inputs = to_device({k: v for k, v in batch.items() if k not in (*COUNTS, "labels")}, device)
            with autocast or nullcontext():
                return model(**inputs, use_cache=False).logits[:, -length:].float()

        alone = torch.cat([logits(collate([examples[1]])), logits(collate([examples[3]]))])
        shift = (logits(open_rows) - alone).abs().max().item()
        moved = (logits(packed) - alone).abs().max().item()
    finally:
        model.train(was_training)
    return moved / shift if shift > 0 else 0.0


def check_packed_attention(model: torch.nn.Module, vocab_size: int,
                           autocast: AbstractContextManager | None = None) -> None:
    """Refuse (one line naming ``data.packing``) a model whose attention lets packed examples see each other."""
    share = leak_share(model, vocab_size, autocast=autocast)
    if share > LEAK_SHARE:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "unknown")
        raise ConfigError(
            f"data.packing=true: this model's attention (attn_implementation={impl}) does not keep packed "
            f"examples apart (restarting position_ids moved a packed example's logits {share:.0%} of the way to "
            "attending across examples); set data.packing=false"
        )
