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
