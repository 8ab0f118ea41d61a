"""Parameter counts and training FLOPs per token, computed from the model config alone (no weights built).

The planner needs them without a GPU or a model, and MFU needs FLOPs per token; both must agree with
what ``transformers`` actually builds, which ``tests/test_flops.py`` checks parameter for parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddptrain.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a causal LM; ``embedding`` is token (+ position) embeddings and an untied lm_head."""

    total: int
    embedding: int
    non_embedding: int


def llama_intermediate_size(hidden_size: int) -> int:
    """SwiGLU MLP width: 8/3 of hidden (same parameters as a 4x GELU MLP), rounded up to a multiple of 32."""
    return -(-8 * hidden_size // (3 * 32)) * 32


def head_dim(model_cfg: ModelConfig) -> int:
    """Width of one attention head: ``model.head_dim``, else hidden_size / num_heads."""
    return model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_heads


def count_params(model_cfg: ModelConfig, vocab_size: int) -> ParamCount:
    """Exact parameter count of the HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``GPT2LMHeadModel`` this config
    builds."""
    h, layers, vocab = model_cfg.hidden_size, model_cfg.num_layers, vocab_size
    lm_head = 0 if model_cfg.tie_embeddings else vocab * h
    if model_cfg.arch in ("llama", "qwen3"):
        width = head_dim(model_cfg)
        inter = model_cfg.intermediate_size or llama_intermediate_size(h)
        kv_heads = model_cfg.num_kv_heads or model_cfg.num_heads
        attn = 2 * h * width * (model_cfg.num_heads + kv_heads)  # q and o per head; k and v per kv head
        qk_norm = 2 * width if model_cfg.arch == "qwen3" else 0  # RMSNorm weights on queries and keys
        per_layer = attn + qk_norm + 3 * h * inter + 2 * h  # gate/up/down; two RMSNorm weights
        embedding = vocab * h + lm_head
        non_embedding = layers * per_layer + h  # + final RMSNorm
    elif model_cfg.arch == "gpt2":
        inter = model_cfg.intermediate_size or 4 * h
        attn = (h * 3 * h + 3 * h) + (h * h + h)  # c_attn, c_proj with biases
        mlp = (h * inter + inter) + (inter * h + h)  # c_fc, c_proj with biases
        per_layer = attn + mlp + 2 * 2 * h  # ln_1, ln_2: weight and bias
        embedding = vocab * h + model_cfg.max_position_embeddings * h + lm_head
        non_embedding = layers * per_layer + 2 * h  # + ln_f
    else:
        raise ValueError(f"unknown model.arch {model_cfg.arch!r}: expected llama, qwen3 or gpt2")
    return ParamCount(total=embedding + non_embedding, embedding=embedding, non_embedding=non_embedding)


def flops_per_token(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight plus 12·L·H·Q·T for attention (PaLM appendix B, torchtitan).

    The matmul weights are the non-embedding ones plus the output projection, which is a matmul even when
    tied; embedding lookups cost no FLOPs.
    """
    matmul_params = count_params(model_cfg, vocab_size).non_embedding + vocab_size * model_cfg.hidden_size
    attention = attention_flops(model_cfg.num_layers, model_cfg.num_heads, head_dim(model_cfg))
    return 6.0 * matmul_params + attention * seq_len


def attention_flops(layers: int, heads: int, width: int) -> float:
    """Attention's training FLOPs per pair of tokens it relates, 12·L·H·Q (forward: QKᵀ and the weighted sum of
    V, 2·2·H·Q per pair and layer; backward twice that), counted over every pair of a sequence as PaLM and
    torchtitan count it: a sequence of T tokens costs 12·L·H·Q·T², a token of it 12·L·H·Q·T. Rows packed with
    several examples relate only the pairs within each example, so they cost 12·L·H·Q·Σ Tᵢ², not ·seq_len²."""
    return 12.0 * layers * heads * width


def pretrained_attention_flops(config: Any) -> float:
    """``attention_flops`` for a loaded ``transformers`` config (its layers, heads and head width)."""
    heads = config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // heads
    return attention_flops(config.num_hidden_layers, heads, width)


def linear_shapes(model_cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(module name, in features, out features) of every linear layer in one block, as ``transformers`` names them."""
    h = model_cfg.hidden_size
    if model_cfg.arch == "gpt2":
        inter = model_cfg.intermediate_size or 4 * h
        return [("c_attn", h, 3 * h), ("c_proj", h, h), ("c_fc", h, inter), ("c_proj", inter, h)]
    width = head_dim(model_cfg)
    inter = model_cfg.intermediate_size or llama_intermediate_size(h)
    q, kv = model_cfg.num_heads * width, (model_cfg.num_kv_heads or model_cfg.num_heads) * width
    return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h), ("gate_proj", h, inter),
            ("up_proj", h, inter), ("down_proj", inter, h)]


def lora_param_count(model_cfg: ModelConfig) -> int:
    """Adapter parameters: r·(in + out) per targeted linear layer (``all-linear``: every block's, not lm_head)."""
    targets = set(model_cfg.lora.target_modules)
    per_block = sum(i + o for name, i, o in linear_shapes(model_cfg) if "all-linear" in targets or name in targets)
    return model_cfg.lora.r * per_block * model_cfg.num_layers
