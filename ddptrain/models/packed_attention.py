"""Whether a model keeps packed examples apart: measured once on the model itself before training packs data.

transformers builds a block-diagonal causal mask from ``position_ids`` that restart at 0 (sdpa, eager, flex)
or runs FlashAttention's varlen kernels; a model (or attention implementation) that does not would let every
example attend to the ones packed before it, silently. The check runs one example alone and behind another
in one row, and refuses the model when the second example's logits move by a visible share of what an open
(causal, unseparated) row moves them.
"""

from __future__ import annotations

import torch

from ddptrain.errors import ConfigError

LEAK_SHARE = 0.05  # the packed logits may move by this share of an unseparated row's shift (rounding: ~1e-6)


@torch.no_grad()
def leak_share(model: torch.nn.Module, vocab_size: int, length: int = 6) -> float:
    """How far a second packed example's logits move, as a share of how far attending to the first moves them:
    ~0 when packed examples are kept apart, ~1 when they attend to each other."""
    device = next(p.device for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab_size, (1, length), generator=g).to(device) for _ in range(2))
    row = torch.cat([first, second], dim=1)
    restart = torch.arange(length, device=device).repeat(2)[None]
    was_training = model.training
    model.eval()
    try:
        def logits(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, -length:].float()

        alone = logits(second, restart[:, :length])
        packed = logits(row, restart)
        open_row = logits(row, torch.arange(2 * length, device=device)[None])
    finally:
        model.train(was_training)
    shift = (open_row - alone).abs().max().item()
    return (packed - alone).abs().max().item() / shift if shift > 0 else 0.0


def check_packed_attention(model: torch.nn.Module, vocab_size: int) -> None:
    """Refuse (one line naming ``data.packing``) a model whose attention lets packed examples see each other."""
    share = leak_share(model, vocab_size)
    if share > LEAK_SHARE:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "unknown")
        raise ConfigError(
            f"data.packing=true: this model's attention (attn_implementation={impl}) does not keep packed "
            f"examples apart (restarting position_ids moved a packed example's logits {share:.0%} of the way to "
            "attending across examples); set data.packing=false"
        )
