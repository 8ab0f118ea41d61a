"""An NF4 base on fake tensors, as bitsandbytes holds one: packed 4-bit weights and their quantization state.

bitsandbytes' ``Params4bit`` cannot wrap a fake tensor, but its quantization and matmul ops have fake kernels.
So the traced model is built as ``from_pretrained`` builds a 4-bit model (transformers' quantizer swaps the
same Linear layers for ``bnb.nn.Linear4bit``), and each of those layers gets what loading would give it:
``bitsandbytes.functional.quantize_4bit`` of a fake weight in ``model.dtype``, with the load's block size and
double quantization, held in a plain frozen parameter that carries the quantization state and the
attributes peft and bitsandbytes read from a ``Params4bit``. Forward and backward then run bitsandbytes' own
``Linear4bit`` and ``matmul_4bit`` (and peft's 4-bit LoRA layer).

One op needs more than its fake kernel: ``gemm_4bit`` (the frozen matmul in forward) allocates a dequantized
copy of the weight inside its kernel, which a fake kernel does not show. The tracker runs it as bitsandbytes'
kernel does (``telemetry/nf4_kernels.py``).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.quantizers import AutoHfQuantizer

from ddptrain.config.schema import ModelConfig
from ddptrain.models.lora import DTYPES, nf4_quantization_config, quiet_bitsandbytes

quiet_bitsandbytes()  # before bitsandbytes' first import, which warns on CPU about an optional kernel package
import bitsandbytes as bnb  # noqa: E402

SETTINGS = ("blocksize", "compress_statistics", "quant_type", "quant_storage")  # of a Params4bit, as loaded


def convert_to_4bit_layers(model: PreTrainedModel) -> None:
    """Swap the Linear layers that a 4-bit load quantizes for ``bnb.nn.Linear4bit`` (on ``meta``): transformers'
    own quantizer decides which (the output embeddings and tied weights stay in ``model.dtype``).

    Each layer's weight becomes a plain meta parameter carrying its ``Params4bit`` settings (block size, double
    quantization, type, storage: what peft reads when it wraps the layer), so that the model can be given fake
    storage and then quantized by ``quantize_4bit_layers``.
    """
    quantizer = AutoHfQuantizer.from_config(nf4_quantization_config(), pre_quantized=False)
    quantizer.preprocess_model(model=model, device_map={"": "cpu"})
    model.is_loaded_in_4bit = True  # what the load sets afterwards; peft reads it
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            settings = {name: getattr(layer.weight, name) for name in SETTINGS}
            weight = torch.nn.Parameter(torch.empty(layer.out_features, layer.in_features, device="meta"),
                                        requires_grad=False)
            for name, value in settings.items():
                setattr(weight, name, value)
            layer.weight, layer.params4bit_settings = weight, settings


def quantize_4bit_layers(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Quantize every ``Linear4bit`` weight of a fake model as a load does, from a weight in ``model.dtype``: a
    packed weight and its quantization state.

    Call under the ``FakeTensorMode`` that holds the model. bitsandbytes caches its 8-bit code for the block
    scales on first use: it is created here on real tensors first, so the cache never holds a fake tensor.
    """
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        bnb.functional.quantize_4bit(torch.zeros(64), compress_statistics=True, quant_type="nf4")
    for layer in model.modules():
        if not isinstance(layer, bnb.nn.Linear4bit):
            continue
        settings = layer.params4bit_settings
        weight = torch.empty(layer.out_features, layer.in_features, dtype=DTYPES[cfg.dtype])
        packed, state = bnb.functional.quantize_4bit(weight, **settings)
        param = torch.nn.Parameter(packed, requires_grad=False)
        # what Linear4bit.forward and peft's 4-bit LoRA layer read from a Params4bit
        for name, value in settings.items():
            setattr(param, name, value)
        param.quant_state, param.bnb_quantized = state, True
        layer.weight = param
        layer.quant_state = state
