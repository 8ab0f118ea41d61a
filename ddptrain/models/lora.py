"""Fine-tuning a pretrained model: base dtype and 4-bit loading, activation checkpointing, LoRA adapters (peft).

Only adapter parameters require gradients, so DDP (and our engines, which bucket ``requires_grad`` parameters
only) all-reduce adapter gradients alone: the frozen base never crosses the wire.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddptrain.config.choices import BaseDtype, Quantize
from ddptrain.config.schema import ModelConfig
from ddptrain.errors import ConfigError, flat
from ddptrain.models.checkpointing import checkpoint_kwargs
from ddptrain.models.finetune_rules import validate_finetune_config  # noqa: F401 - its home before; torch-free there

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
DTYPES = {BaseDtype.fp32: torch.float32, BaseDtype.bf16: torch.bfloat16}


def reentrant_failure(exc: BaseException) -> ConfigError:
    """The one line for a backward that failed under ``model.checkpoint_reentrant=true``.

    Reentrant checkpointing re-runs each block's forward inside backward; under DDP that can mark a gradient
    ready twice ("Expected to mark a variable ready only once"), and behind frozen inputs it skips the block's
    gradients. The non-reentrant variant has neither problem.
    """
    first = flat(str(exc), 160)
    return ConfigError(f"model.checkpoint_reentrant=true: backward failed under data parallelism ({first}); "
                       "set model.checkpoint_reentrant=false")


def load_kwargs(cfg: ModelConfig, device: torch.device | None) -> dict[str, Any]:
    """``from_pretrained`` arguments: the base dtype, this rank's device only, and NF4 quantization if asked."""
    device = device or torch.device("cpu")
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype],
                              "device_map": {"": device.index if device.type == "cuda" else device.type}}
    if cfg.quantize == Quantize.nf4:
        kwargs["quantization_config"] = nf4_quantization_config()
    return kwargs


def nf4_quantization_config() -> Any:
    """The 4-bit load (QLoRA): NF4 weights in blocks of 64 (bitsandbytes' default), their block scales quantized
    again (double quantization), compute in bf16. The memory trace builds its NF4 base from the same config."""
    from transformers import BitsAndBytesConfig

    quiet_bitsandbytes()
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def quiet_bitsandbytes() -> None:
    """Drop bitsandbytes' import-time warning that an optional CPU kernel package is missing (each rank prints it;
    the run is correct without it)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_missing_cpu_kernel)


def _not_missing_cpu_kernel(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


@contextmanager
def _bitsandbytes_hidden(cfg: ModelConfig) -> Iterator[None]:
    """Use peft without importing bitsandbytes, unless ``model.quantize=nf4``.

    peft imports bitsandbytes whenever it is installed, on import and again when it adds adapters (and
    bitsandbytes warns on import on CPU); a full-precision base needs none of it. A ``None`` entry in
    ``sys.modules`` makes ``import bitsandbytes`` raise ImportError, which peft catches. peft caches whether
    bitsandbytes is available, so the cache is cleared afterwards: a 4-bit model later in this process (tests
    train several) gets bitsandbytes' layers again.
    """
    if cfg.quantize == Quantize.nf4 or "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]
        checks = sys.modules.get("peft.import_utils")  # None: peft was not needed (no adapters)
        if checks is not None:
            checks.is_bnb_available.cache_clear()
            checks.is_bnb_4bit_available.cache_clear()


@contextmanager
def _peft_deprecations_hidden() -> Iterator[None]:
    """peft reads ``model.is_gradient_checkpointing`` and calls ``gradient_checkpointing_enable``, which
    transformers 5 deprecates with a FutureWarning on every rank: not the user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message="`gradient_checkpointing_enable` is deprecated",
                                category=FutureWarning)
        yield


def check_cpu_4bit_widths(model: torch.nn.Module) -> None:
    """bitsandbytes' CPU 4-bit kernels repack each weight in blocks of 64 inputs x 32 outputs (at evaluation, on
    CPUs with AVX512-BF16) and fail with a traceback on any other width: refuse such a model at start-up."""
    import bitsandbytes as bnb

    for name, layer in model.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit) and (layer.in_features % 64 or layer.out_features % 32):
            raise ConfigError(
                f"model.quantize=nf4 on CPU: {name} maps {layer.in_features} to {layer.out_features} features; "
                "bitsandbytes' CPU 4-bit kernels need inputs in multiples of 64 and outputs in multiples of 32 "
                "(use a base model with such widths, or quantize on a GPU)")


def prepare_for_finetuning(model: PreTrainedModel, cfg: ModelConfig) -> torch.nn.Module:
    """Activation checkpointing (``ddptrain/models/checkpointing.py``), k-bit preparation and LoRA adapters, as
    ``model.*`` asks; in training mode.

    ``from_pretrained`` returns a model in eval mode, and peft keeps it so: its blocks would then skip gradient
    checkpointing (transformers checkpoints a block only while ``self.training``) and its dropout until the first
    evaluation. So the model is switched to training mode here, where it is made ready to train.
    """
    with _bitsandbytes_hidden(cfg):
        prepared = _adapt(model, cfg)
    if cfg.quantize == Quantize.nf4:
        keep_training_layout(prepared)
    prepared.train()
    return prepared


def keep_training_layout(model: torch.nn.Module) -> None:
    """Keep every 4-bit layer in the layout training differentiates through.

    On a CPU with AVX512-BF16, bitsandbytes 0.50.2 repacks a ``Linear4bit``'s weight for inference at its first
    forward in eval mode (an evaluation) and keeps it so: every later forward, training ones included, then runs
    ``bitsandbytes::gemv_4bit``, which has no autograd kernel. torch warns ("an autograd kernel was not
    registered ... silently incorrect behavior") and the gradient through the frozen base weight is dropped, so
    after the first evaluation the adapters of every layer but the last got wrong gradients (98-184 % off a
    dequantized reference here, tests/test_finetune.py). Without the repacking, evaluation runs the same
    dequantizing ``gemm_4bit`` as training."""
    import bitsandbytes as bnb

    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            layer.support_avx512bf16_for_cpu = False  # read by Linear4bit.forward before it repacks


def _adapt(model: PreTrainedModel, cfg: ModelConfig) -> torch.nn.Module:
    ckpt_kwargs = checkpoint_kwargs(cfg)
    if cfg.quantize == Quantize.nf4:
        from peft import prepare_model_for_kbit_training

        # Freezes the base, keeps norms and embeddings in fp32, and (with checkpointing) makes the embedding
        # output require grad so that adapters behind frozen inputs still receive gradients.
        with _peft_deprecations_hidden():
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=ckpt_kwargs is not None, gradient_checkpointing_kwargs=ckpt_kwargs
            )
    elif ckpt_kwargs is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    if not cfg.lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora.target_modules
    lora = LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, task_type="CAUSAL_LM",
        target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
    )
    try:
        with _peft_deprecations_hidden():
            return get_peft_model(model, lora)  # adapters in fp32 whatever the base dtype (peft's default)
    except ValueError as exc:
        raise ConfigError(f"model.lora.target_modules={list(targets)}: {flat(str(exc), 200)}") from exc


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a 4-bit weight counts as the elements it stands for, not its packed bytes."""
    trainable = total = 0
    for p in model.parameters():
        quant = getattr(p, "quant_state", None)
        n = quant.shape.numel() if quant is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def trainable_line(trainable: int, total: int, comm_bytes: float | None, warmup_bytes: float | None = None) -> str:
    """``1.2M of 1.1B trainable; 4.8 MB all-reduced per step`` (bytes measured on the first step, if any, with
    the compression in effect). ``warmup_bytes``: what the first steps send instead, while a compression that
    starts late (PowerSGD) is not in effect yet."""
    line = f"{_count(trainable)} of {_count(total)} trainable"
    if comm_bytes is None:
        return line
    line = f"{line}; {comm_bytes / 1e6:.3g} MB all-reduced per step"
    if warmup_bytes is None or warmup_bytes == comm_bytes:
        return line
    return f"{line} ({warmup_bytes / 1e6:.3g} MB on the steps before the compression starts)"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether peft added adapters; a run that never imported peft has none (and does not import it now)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def export_adapter_and_merged(model: torch.nn.Module, cfg: ModelConfig, tokenizer: Any, run_dir: Path) -> None:
    """Rank 0: the adapter in peft's format (``adapter/``) and the merged model (``model/``, save_pretrained).

    Full-precision bases merge in place (the run is over). A 4-bit base is reloaded unquantized from
    ``model.pretrained`` and the adapter merged into it: merging into NF4 would quantize the update away.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = run_dir / "adapter"
    model.save_pretrained(str(adapter))
    if cfg.quantize == Quantize.nf4:
        base = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=DTYPES[cfg.dtype], device_map={"": "cpu"})
        with _peft_deprecations_hidden():
            merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    else:
        merged = model.merge_and_unload()  # type: ignore[operator]
    merged.save_pretrained(str(run_dir / "model"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(run_dir / "model"))
    log.info("adapter saved in %s; merged model exported with save_pretrained: %s", adapter, run_dir / "model")
