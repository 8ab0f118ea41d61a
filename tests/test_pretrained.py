"""A model loaded with ``from_pretrained`` trains as users expect: in training mode (checkpointing and dropout on),
without a KV cache, with one compiled graph for all its blocks, and without bitsandbytes unless it is quantized."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, LlamaConfig, Qwen3Config

from ddptrain.config.schema import Config, LoraSettings, ModelConfig
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.models.attention import use_causal_attention
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.step.compute import accumulate_gradients
from tests.helpers.compile_backend import module_compile_backend
from tests.helpers.dist import run_distributed
from tests.helpers.pretrained import count_checkpoint_calls, save_tiny_llama, saved_activation_bytes, train_each_watched
from tests.helpers.tiny import TINY_MODEL

LORA = LoraSettings(enabled=True, r=4, alpha=8.0)
IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))


def _loaded(base: Path, **model: Any) -> torch.nn.Module:
    """The base as a run prepares it: loaded through model.pretrained, then prepared for training."""
    cfg = ModelConfig(pretrained=str(base), **model)
    return prepare_for_finetuning(build_model(cfg, 384), cfg)


def test_from_pretrained_returns_eval_mode_and_configs_default_to_a_kv_cache(pretrained_base: Path) -> None:
    """Library behaviour the build relies on (and corrects): a loaded model starts in eval mode, peft keeps it so,
    and a forward left to the config's default builds a KV cache."""
    from peft import LoraConfig, get_peft_model

    loaded = AutoModelForCausalLM.from_pretrained(pretrained_base)
    assert not loaded.training and not any(m.training for m in loaded.modules())
    get_peft_model(loaded, LoraConfig(r=4, target_modules="all-linear"))  # adapts ``loaded`` in place
    assert not loaded.training and not any(block.training for block in loaded.model.layers)  # only adapters train
    assert LlamaConfig().use_cache and GPT2Config().use_cache and Qwen3Config().use_cache
    built: list[int] = []
    init = DynamicCache.__init__
    try:
        DynamicCache.__init__ = lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1]  # type: ignore[method-assign]
        loaded(input_ids=IDS)
    finally:
        DynamicCache.__init__ = init  # type: ignore[method-assign]
    assert built


def test_a_loaded_base_trains_in_training_mode_and_checkpoints_every_block(pretrained_base: Path) -> None:
    plain = _loaded(pretrained_base, lora=LORA)
    checkpointed = _loaded(pretrained_base, lora=LORA, activation_checkpointing="full")
    assert all(m.training for m in checkpointed.modules())
    calls = count_checkpoint_calls(checkpointed)
    per_block = saved_activation_bytes(lambda: checkpointed(input_ids=IDS, labels=IDS, use_cache=False).loss)
    assert calls == [2]  # both blocks checkpointed their forward
    everything = saved_activation_bytes(lambda: plain(input_ids=IDS, labels=IDS, use_cache=False).loss)
    # Checkpointing keeps each block's input instead of its inner activations: far fewer bytes saved for backward.
    assert per_block < everything / 2, (per_block, everything)


def test_a_base_saved_with_attention_dropout_trains_with_it(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path, attention_dropout=0.5)
    model = _loaded(base, lora=LORA)
    assert model.config.attention_dropout == 0.5
    first, second = (model(input_ids=IDS, use_cache=False).logits for _ in range(2))
    assert not torch.allclose(first, second)  # dropout draws a new mask each forward: it is on
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, model(input_ids=IDS).logits)


def _evaluate_twice(rank: int, world_size: int, base: str) -> list[bool]:
    from ddptrain.step.compute import evaluate

    model = _loaded(Path(base), lora=LORA, activation_checkpointing="full")
    modes = []
    for _ in range(2):
        evaluate(model, [IDS], nullcontext(), torch.device("cpu"))
        modes.append(all(m.training for m in model.modules()))
    model.eval()
    evaluate(model, [IDS], nullcontext(), torch.device("cpu"))
    return [*modes, model.training]


def test_evaluation_hands_the_model_back_in_the_mode_it_found_it(pretrained_base: Path) -> None:
    (modes,) = run_distributed(_evaluate_twice, 1, str(pretrained_base))
    assert modes == [True, True, False]


def _finetune(base: Path) -> dict:
    return {
        "model": {"pretrained": str(base), "lora": {"enabled": True, "r": 4, "alpha": 8.0},
                  "activation_checkpointing": "full"},
        "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(base), "num_samples": 80,
                 "seq_len": 40, "global_batch_size": 4, "micro_batch_size": 2},
        "train": {"steps": 3, "log_every": 1, "eval_every": 1}, "optim": {"warmup_steps": 0},
    }


def test_every_step_of_a_run_trains_every_module_checkpointed_and_without_a_cache(
    pretrained_base: Path, tmp_path: Path
) -> None:
    """Through the real loop, from step 1 and after each evaluation: eval mode would skip checkpointing."""
    (run,) = run_distributed(train_each_watched, 1, str(tmp_path), _finetune(pretrained_base), [{}])[0]
    assert run["training"] == [True] * 3
    assert run["checkpoint_calls"] == 2 * 2 * 3  # 2 blocks x 2 micro batches x 3 steps
    assert run["kv_caches"] == 0
    # its FLOPs per token from its own shape: 2N forward + 2N input gradients + 2 per trainable weight, and
    # attention over seq_len 40 from the saved config (2 layers, 2 heads of width 32): 12·L·H·Q·T
    summary = run["summary"]
    assert summary["flops_per_token"] == (4 * summary["parameters"] + 2 * summary["trainable_parameters"]
                                          + 12 * 2 * 2 * 32 * 40)


def test_a_pretraining_run_without_checkpointing_builds_no_kv_cache(tmp_path: Path) -> None:
    """Fixed blocks from scratch, checkpointing off: transformers turns the cache off by itself only under
    checkpointing, so here every training and evaluation forward must pass ``use_cache=False``."""
    run = {"model": {**TINY_MODEL, "max_position_embeddings": 32},
           "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 16,
                    "global_batch_size": 4, "micro_batch_size": 2},
           "train": {"steps": 2, "log_every": 1, "eval_every": 2}}
    (result,) = run_distributed(train_each_watched, 1, str(tmp_path), run, [{}])[0]
    assert result["checkpoint_calls"] == 0 and result["training"] == [True] * 2  # the plain path, in training mode
    assert "val_loss" in result["metrics"][-1]  # evaluation ran too
    assert result["kv_caches"] == 0


def test_packed_blocks_attend_causally_with_no_host_read_and_the_same_logits() -> None:
    """transformers' mask builder reads a tensor back to the host in every forward without a cache (its search
    for several sequences packed in a row); packed blocks skip the mask and keep SDPA's causal result."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    reads: list[int] = []
    original = torch.Tensor.__bool__

    def forward() -> torch.Tensor:
        torch.Tensor.__bool__ = lambda t: (reads.append(1), original(t))[1]  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                return model(input_ids=IDS, use_cache=False).logits
        finally:
            torch.Tensor.__bool__ = original  # type: ignore[method-assign]

    masked = forward()
    assert reads, "transformers no longer reads the packing check back: this module may be unneeded"
    reads.clear()
    use_causal_attention(model)
    torch.testing.assert_close(forward(), masked)
    assert reads == []


def _compiled_graphs(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """A 12-block model's compiled blocks through the training forward: Dynamo's counts of graphs and frames."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ddptrain.parallel.compile import compile_blocks

    torch.compiler.reset()
    counters.clear()
    cfg = ModelConfig(hidden_size=32, num_layers=12, num_heads=2)
    model = build_model(cfg, 256)
    use_causal_attention(model)
    with module_compile_backend(backend):
        assert compile_blocks(model) == 12
    ids = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        accumulate_gradients(model, iter([ids]), 1, lambda _: nullcontext(), nullcontext())
    return {"graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"])}


def test_twelve_compiled_blocks_share_one_graph_without_recompiling() -> None:
    """A KV cache in the training forward made Dynamo guard on each layer's cache state: one graph per block up to
    the recompile limit (8), the rest eager. Dynamo's eager backend: the guards are the same as Inductor's. The same
    rule through the loop under Inductor (``train.compile=true``), on 2 ranks under DDP, is checked by the slow
    ``tests/test_hot_path.py::test_compiled_blocks_under_ddp_match_eager_share_one_graph_and_report_compile_time``,
    whose compiled run serves both."""
    (ran,) = run_distributed(_compiled_graphs, 1, "eager")
    assert ran == {"graphs": 1, "frames": {"total": 1, "ok": 1}}


def _modules_after(rank: int, world_size: int, tmp: str, base: str, quantize: bool) -> dict[str, Any]:
    """Train without quantization (plain and LoRA), or build a QLoRA model; what was imported and logged."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    imported_before = "bitsandbytes" in sys.modules
    if quantize:
        cfg = ModelConfig(pretrained=base, quantize="nf4", lora=LORA, activation_checkpointing="full")  # type: ignore[arg-type]
        model = prepare_for_finetuning(build_model(cfg, 384), cfg)
        model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    else:
        from tests.helpers.runs import train_each

        lora = _finetune(Path(base))
        lora["train"] = {"steps": 1, "eval_every": 0}
        plain = {"data": {"source": "synthetic", "num_samples": 32, "vocab_size": 256, "seq_len": 16,
                          "global_batch_size": 2, "micro_batch_size": 2},
                 "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
                 "train": {"steps": 1, "eval_every": 0}, "checkpoint": {"export": True}}
        train_each(rank, world_size, tmp, plain, [{}])
        train_each(rank, world_size, tmp + "/lora", lora, [{"checkpoint": {"export": True}}])
    return {"before": imported_before, "after": "bitsandbytes" in sys.modules, "records": records}


def test_a_run_without_quantization_never_imports_bitsandbytes(pretrained_base: Path, tmp_path: Path) -> None:
    (seen,) = run_distributed(_modules_after, 1, str(tmp_path), str(pretrained_base), False)
    assert seen["before"] is False and seen["after"] is False


def test_a_qlora_model_loads_without_bitsandbytes_missing_kernel_warning(pretrained_base: Path) -> None:
    (seen,) = run_distributed(_modules_after, 1, "", str(pretrained_base), True)
    assert seen["before"] is False and seen["after"] is True  # bitsandbytes was imported here, for this model
    assert not [r for r in seen["records"] if "gemm_4bit_forward" in r], seen["records"]


def test_a_4bit_base_whose_widths_the_cpu_kernels_cannot_pack_is_refused_naming_the_layer(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path, intermediate_size=344)  # llama_tiny's former SwiGLU width
    cfg = ModelConfig(pretrained=str(base), quantize="nf4", lora=LORA)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^model\.quantize=nf4 on CPU: model\.layers\.0\.mlp\.gate_proj maps 64 "
                                          r"to 344 features; bitsandbytes' CPU 4-bit kernels need inputs in multiples "
                                          r"of 64 and outputs in multiples of 32"):
        build_model(cfg, 384)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(__file__).parents[1] / "configs/model").glob("*.yaml")))
def test_every_model_preset_has_widths_the_cpu_4bit_kernels_accept(preset: str, compose: Callable[..., Config]) -> None:
    """So that a model a preset trains (the quickstart's) fine-tunes under QLoRA on CPU: every quantizable layer
    takes inputs in multiples of 64 and gives outputs in multiples of 32."""
    cfg = compose(f"model={preset}").model
    with torch.device("meta"):
        model = build_model(cfg, cfg.vocab_size or 8192)
    widths = {name: tuple(m.weight.shape) for name, m in model.named_modules()
              if type(m).__name__ in ("Linear", "Conv1D") and name != "lm_head"}
    assert widths
    for name, shape in widths.items():
        n_out, n_in = shape if type(model.get_submodule(name)).__name__ == "Linear" else shape[::-1]
        assert n_in % 64 == 0 and n_out % 32 == 0, (preset, name, n_in, n_out)
