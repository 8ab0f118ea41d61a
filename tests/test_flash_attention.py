"""FlashAttention-2 for packed rows, run on CPU through transformers' real FA2 integration and the flash-attn twin
(``tests/helpers/flash_attn_twin.py``): packed examples stay apart in any number of rows, the start-up check
catches a leak, fp32 keeps sdpa, and sdpa's packed path reads nothing back from the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from ddptrain.config.choices import Precision
from ddptrain.data.packing import REAL_TOKENS, PackCollate
from ddptrain.models.attention import use_varlen_attention
from tests.helpers.flash_attn_twin import Calls, install

VOCAB = 128
ARCHS = {
    "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}
LENGTHS = [9, 7, 8, 6]  # rows of 16: [9 + 7] and [8 + 6] (best-fit decreasing)


@pytest.fixture
def twin(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return install(monkeypatch)


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS[arch], attn_implementation="sdpa").eval()


def _examples() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def _inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k not in (REAL_TOKENS, "labels")}


@torch.no_grad()
def _logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**_inputs(batch), use_cache=False).logits.float()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_second_example_of_each_packed_row_sees_only_itself_under_flash_attention(arch: str, twin: Calls) -> None:
    """Two rows of two examples each: every example's logits equal running it alone (bf16, the twin's SDPA)."""
    model = _model(arch)
    assert use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    assert model.config._attn_implementation == "flash_attention_2"
    examples = _examples()
    collate = PackCollate(pad_id=0, seq_len=16)
    packed = collate(examples)
    assert packed["input_ids"].shape == (2, 16)  # packing was on: four examples in two rows
    got = _logits(model, packed)
    layers = ARCHS[arch].num_hidden_layers
    assert (twin.varlen, twin.dense) == (layers, 0), "every layer ran the varlen kernel, none the per-row one"
    cu, longest = twin.segments[0]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 16, 24, 30, 32] and longest == 9  # tail of 2: its own
    starts = {0: 0, 1: 9, 2: 0, 3: 8}
    rows = {0: 0, 1: 0, 2: 1, 3: 1}
    worst = 0.0
    for i, example in enumerate(examples):
        alone = _logits(model, collate([example]))[0]
        n = LENGTHS[i]
        worst = max(worst, (got[rows[i], starts[i] : starts[i] + n] - alone).abs().max().item())
    assert worst < 0.01, f"packed examples' logits moved by {worst:.3f} from running each alone"
