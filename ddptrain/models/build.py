"""Hugging Face causal LMs built from ``model.*`` (no download), or loaded from ``model.pretrained``."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen3Config

from ddptrain.config.choices import Quantize
from ddptrain.config.schema import ModelConfig
from ddptrain.errors import ConfigError
from ddptrain.models.flops import head_dim, llama_intermediate_size
from ddptrain.models.lora import check_cpu_4bit_widths, load_kwargs

log = logging.getLogger(__name__)


def model_vocab_size(cfg: ModelConfig, data_vocab: int) -> int:
    """The embedding rows: the configured size, or the data's vocabulary rounded up to a multiple of 64."""
    if cfg.vocab_size is None:
        return -(-data_vocab // 64) * 64
    if cfg.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary ({data_vocab})")
    return cfg.vocab_size


def hf_config(cfg: ModelConfig, vocab_size: int, eos_id: int | None) -> PretrainedConfig:
    special = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": None}
    if cfg.arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            tie_word_embeddings=cfg.tie_embeddings, **special,
        )
    config_class = Qwen3Config if cfg.arch == "qwen3" else LlamaConfig
    return config_class(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size or llama_intermediate_size(cfg.hidden_size),
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, head_dim=head_dim(cfg),
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, **special,
    )


def build_model(
    cfg: ModelConfig, vocab_size: int, eos_id: int | None = None, device: torch.device | None = None
) -> PreTrainedModel:
    """A freshly initialised model on the CPU (the caller moves it), or the weights at ``model.pretrained``.

    Pretrained weights load straight onto ``device`` (this rank's device only: a whole replica per rank), in
    ``model.dtype``, 4-bit quantized when ``model.quantize=nf4``.
    Transformers' progress bars are off from here on (per-rank "Loading weights", the export's "Writing model
    shards"): a run's log carries ddptrain's lines, not a library's bars.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if cfg.pretrained is not None:
        return with_named_loss(_load_pretrained(cfg, vocab_size, device))
    return with_named_loss(AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, eos_id),
                                                            attn_implementation="sdpa"))


def with_named_loss(model: PreTrainedModel) -> PreTrainedModel:
    """The model, its loss named. transformers finds a model's loss in its class name; GPT-2's
    (``GPT2LMHeadModel``) names none, so the first loss printed "`loss_type=None` was set in the config but it is
    unrecognized. Using the default loss: `ForCausalLMLoss`" (at the top of every GPT-2 dry run). The loss is
    that same default, named here."""
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model


def _load_pretrained(cfg: ModelConfig, data_vocab: int, device: torch.device | None) -> PreTrainedModel:
    name = cfg.pretrained
    assert name is not None
    local = Path(name).exists()
    try:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=local, **load_kwargs(cfg, device))
    except Exception as exc:
        raise ConfigError(f"model.pretrained={name}: cannot load a causal LM ({type(exc).__name__})") from exc
    if cfg.quantize == Quantize.nf4 and (device is None or device.type == "cpu"):
        check_cpu_4bit_widths(model)
    if model.get_input_embeddings().num_embeddings < data_vocab:
        raise ConfigError(
            f"model.pretrained={name}: {model.get_input_embeddings().num_embeddings} embedding rows but the data "
            f"uses ids up to {data_vocab - 1}; use the model's own tokenizer (data.tokenizer)"
        )
    return model
