"""The analytic parameter count matches what transformers builds, and FLOPs per token follow the convention."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config, ModelConfig
from ddptrain.models.build import build_model, hf_config
from ddptrain.models.flops import count_params, flops_per_token, llama_intermediate_size

VOCAB = 96


def built_params(cfg: ModelConfig, vocab: int) -> int:
    """Parameters of the model the builder makes, tied tensors counted once; on the meta device, so no memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab, eos_id=None))
    return sum(p.numel() for p in model.parameters())


SHAPES = [
    ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4),
    ModelConfig(arch="llama", hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2, tie_embeddings=False),
    ModelConfig(arch="llama", hidden_size=96, num_layers=1, num_heads=6, num_kv_heads=3, intermediate_size=200),
    ModelConfig(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    ModelConfig(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                intermediate_size=128, tie_embeddings=False),
    ModelConfig(arch="gpt2", hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=32),
    ModelConfig(arch="gpt2", hidden_size=48, num_layers=3, num_heads=3, intermediate_size=100, tie_embeddings=False),
]


def shape_id(cfg: ModelConfig) -> str:
    return f"{cfg.arch}-h{cfg.hidden_size}-kv{cfg.num_kv_heads}-d{cfg.head_dim}-tied{cfg.tie_embeddings}"


@pytest.mark.parametrize("cfg", SHAPES, ids=shape_id)
def test_count_params_matches_the_built_model(cfg: ModelConfig) -> None:
    count = count_params(cfg, VOCAB)
    assert count.total == built_params(cfg, VOCAB)
    assert count.total == count.embedding + count.non_embedding


def test_gpt2_small_has_124_439_808_parameters() -> None:
    cfg = ModelConfig(arch="gpt2", hidden_size=768, num_layers=12, num_heads=12, max_position_embeddings=1024)
    assert count_params(cfg, 50257).total == 124_439_808 == built_params(cfg, 50257)


def test_qlora_4b_experiment_is_shaped_like_qwen3_4b() -> None:
    """Qwen3-4B: 4,022,468,096 parameters (embeddings tied), the figure its model card rounds to 4.0B."""
    experiment = OmegaConf.load(Path(__file__).parents[1] / "configs" / "experiment" / "qlora_4b.yaml")
    model = OmegaConf.to_container(experiment.model)
    shape = {k: v for k, v in model.items() if k not in ("lora", "pretrained")}  # type: ignore[union-attr]
    cfg = build_config({"model": shape}).model
    assert cfg.arch == "qwen3" and cfg.head_dim == 128
    assert count_params(cfg, cfg.vocab_size).total == 4_022_468_096 == built_params(cfg, cfg.vocab_size)


def test_untied_head_counts_as_embedding() -> None:
    tied = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4)
    untied = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, tie_embeddings=False)
    assert count_params(untied, VOCAB).embedding - count_params(tied, VOCAB).embedding == VOCAB * 64
    assert count_params(untied, VOCAB).non_embedding == count_params(tied, VOCAB).non_embedding


def test_llama_intermediate_size_is_swiglu_rounded_to_32() -> None:
    assert llama_intermediate_size(128) == 352  # 8/3·128 = 341.3
    assert llama_intermediate_size(96) == 256  # exactly 8/3·96
    assert llama_intermediate_size(4096) % 32 == 0


def test_flops_per_token_is_six_per_matmul_weight_plus_attention() -> None:
    cfg = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, tie_embeddings=False)
    matmul_weights = count_params(cfg, VOCAB).non_embedding + VOCAB * 64
    assert flops_per_token(cfg, VOCAB, seq_len=32) == 6 * matmul_weights + 12 * 2 * 4 * 16 * 32
    # grouped-query attention: every query head attends (4 here), however few key/value heads they share (1)
    gqa = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, tie_embeddings=False)
    matmul_weights = count_params(gqa, VOCAB).non_embedding + VOCAB * 64
    assert flops_per_token(gqa, VOCAB, seq_len=32) == 6 * matmul_weights + 12 * 2 * 4 * 16 * 32


def _examples(lengths: list[int]) -> list[dict[str, list[int]]]:
    return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]


def test_a_packed_micro_batch_counts_attention_per_example_not_per_row() -> None:
    """Examples of 5, 3, 7 and 2 tokens packed into rows of 10 (7+3 and 5+2): attention relates
    5² + 3² + 7² + 2² = 87 token pairs, where seq_len² per row would say 2 x 100 and seq_len per token 170."""
    from ddptrain.config.schema import MetricsConfig
    from ddptrain.data.batch import BatchShape
    from ddptrain.data.instruct import PadCollate
    from ddptrain.data.loader import TokenCount
    from ddptrain.data.packing import VARLEN_KEYS, PackCollate
    from ddptrain.telemetry.metrics import StepMetrics, TokenFlops

    rows = _examples([5, 3, 7, 2])
    for collate, computed in ((PackCollate(0, 10), 2 * 10), (PadCollate(0), 4 * 7)):
        count = TokenCount()
        inputs = count.count(collate(rows))
        model_inputs = {"input_ids", "position_ids", "labels", "attention_mask", *VARLEN_KEYS}
        assert set(inputs) <= model_inputs  # the counts are popped
        assert count.take() == (17, computed, 87)
    blocks = TokenCount()
    blocks.count({"input_ids": torch.zeros(2, 10, dtype=torch.long)})
    assert blocks.take() == (20, 20, 200)  # fixed blocks: every row one sequence of seq_len

    dense, attention = 1000.0, 10.0  # FLOPs per token outside attention; 12·L·H·Q
    count = TokenCount()
    meter = StepMetrics(BatchShape.derive(4, 4, 1, 1, 10), torch.device("cpu"),
                        TokenFlops(dense + attention * 10, attention), MetricsConfig(), count)
    meter.start_step(1)
    count.count(PackCollate(0, 10)(rows))
    meter.end_step(None, None)
    m = meter.window(1, 0.0, 0.0, 0.0)
    flops = m["tflops_per_rank"] * 1e12 * m["step_time_s"]
    assert flops == pytest.approx(dense * 17 + attention * 87)  # 17,870
    assert flops != pytest.approx((dense + attention * 10) * 17)  # 18,700: seq_len per token, the old figure
    assert m["attended_tokens"] == pytest.approx(87 / 17) and m["tokens_per_sequence"] == pytest.approx(17 / 4)


def test_a_pretrained_models_attention_flops_come_from_its_own_config() -> None:
    from transformers import LlamaConfig

    from ddptrain.models.flops import attention_flops, pretrained_attention_flops

    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32)
    assert pretrained_attention_flops(config) == attention_flops(3, 4, 32) == 12 * 3 * 4 * 32
    assert pretrained_attention_flops(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)) == (
        12 * 2 * 4 * 16)
    # grouped-query attention: per query head (8), not per key/value head (2)
    gqa = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    assert pretrained_attention_flops(gqa) == 12 * 2 * 8 * 8


def test_the_qwen3_presets_rope_theta_sets_the_built_models_rotary_frequencies(
    compose: Callable[..., Config],
) -> None:
    """``rope_theta: 1e6`` in configs/model/qwen3_tiny.yaml reaches the model (transformers' default is 1e4)."""
    cfg = compose("model=qwen3_tiny").model
    assert cfg.rope_theta == 1e6
    model = build_model(cfg, VOCAB)
    assert model.config.rope_parameters["rope_theta"] == 1e6
    dim = cfg.head_dim
    assert dim is not None
    expected = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected)
