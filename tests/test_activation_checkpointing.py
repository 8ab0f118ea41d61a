"""``model.activation_checkpointing``: none, full and selective give one loss and one set of gradients; what each
recomputes in backward shows it ran (selective: element-wise ops, never a matmul); selective holds less than
none and more than full; the deprecated ``model.gradient_checkpointing`` still works."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.config.schema import LoraSettings, ModelConfig
from ddptrain.errors import ConfigError
from ddptrain.models.build import build_model
from ddptrain.models.lora import prepare_for_finetuning
from tests.helpers.cli import run_cli
from tests.helpers.tiny import TINY_RUN_ARGS

MODES = ("none", "full", "selective")
VOCAB = 256
# Named here, not taken from the policy: a policy that stopped keeping one of them must fail these tests.
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu"}


class Dispatched(TorchDispatchMode):
    """Every op run while it is active, by name (inside custom autograd functions too, as bitsandbytes' 4-bit
    matmul)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def lora_model(arch: str, mode: str, pretrained: Path | None = None) -> torch.nn.Module:
    shape = {} if pretrained else {"arch": arch, "hidden_size": 64, "num_layers": 2, "num_heads": 4}
    cfg = ModelConfig(**shape, pretrained=str(pretrained) if pretrained else None,  # type: ignore[arg-type]
                      quantize="nf4" if pretrained else "none", activation_checkpointing=mode,
                      lora=LoraSettings(enabled=True, r=4, alpha=8.0))
    torch.manual_seed(0)
    model = prepare_for_finetuning(build_model(cfg, VOCAB), cfg)
    if mode == "none":  # as checkpointing does: the embeddings' output requires grad, so backward does the same work
        model.enable_input_require_grads()
    with torch.no_grad():  # LoRA's B starts at zero: set it at random so that A has a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def step(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], Counter[str]]:
    """One forward and backward in fp32: the loss, the adapters' gradients, the ops run in backward."""
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    seed = torch.ones_like(loss)
    backward = Dispatched()
    with backward:
        loss.backward(seed)
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad], backward.ops


def assert_recomputes_as_promised(backward: dict[str, Counter[str]]) -> None:
    """Checkpointing adds its recompute to backward's own ops, which are the same in every mode: the ops beyond
    those of a backward without checkpointing are the recomputed ones."""
    full, selective = backward["full"] - backward["none"], backward["selective"] - backward["none"]
    assert sum(full[op] for op in MATMULS) > 0 and sum(full[op] for op in ATTENTION) > 0  # the whole block again
    assert not set(selective) & (MATMULS | ATTENTION)  # never a matmul nor attention ...
    assert selective["aten::mul.Tensor"] > 0  # ... but the element-wise ops (norms, activations, scaling)
    assert set(selective) <= set(full)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_every_checkpointing_mode_gives_the_same_loss_and_gradients_and_recomputes_what_it_promises(arch: str) -> None:
    results = {mode: step(lora_model(arch, mode)) for mode in MODES}
    loss, grads, _ = results["none"]
    assert len(grads) > 0
    for mode in ("full", "selective"):
        assert results[mode][0] == pytest.approx(loss.item(), rel=1e-6)
        for got, want in zip(results[mode][1], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert_recomputes_as_promised({mode: ops for mode, (_, _, ops) in results.items()})


def test_selective_checkpointing_works_through_peft_kbit_preparation_of_a_4bit_base(pretrained_base: Path) -> None:
    """QLoRA enables checkpointing through peft's ``prepare_model_for_kbit_training``: the policy reaches it too."""
    results = {mode: step(lora_model("llama", mode, pretrained_base)) for mode in MODES}
    for mode in ("full", "selective"):
        assert results[mode][0] == pytest.approx(results["none"][0].item(), rel=1e-6)
        for got, want in zip(results[mode][1], results["none"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_recomputes_as_promised({mode: ops for mode, (_, _, ops) in results.items()})
    # the 4-bit base matmul is bitsandbytes' own kernel on the CPU: full checkpointing runs it again, selective
    # keeps its output
    gemm = {mode: results[mode][2]["bitsandbytes::gemm_4bit"] for mode in MODES}
    assert gemm["full"] > gemm["selective"] == gemm["none"]


def backward_peak(mode: str) -> int:
    """The CPU allocator's highest bytes over one forward and backward (torch.profiler's memory events), above
    what was live before. Width 128, 4 blocks, 2 rows of 128 tokens: selective peaks at 0.74 of none, as at width
    256 with 4 rows of 256 (0.73), for a fifth of the CPU seconds."""
    cfg = ModelConfig(hidden_size=128, num_layers=4, num_heads=4, activation_checkpointing=mode)  # type: ignore
    torch.manual_seed(0)
    model = prepare_for_finetuning(build_model(cfg, VOCAB), cfg)
    ids = torch.randint(0, VOCAB, (2, 128))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    current = highest = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        current += event.nbytes()
        highest = max(highest, current)
    return highest


def test_selective_checkpointing_peaks_below_none_and_above_full() -> None:
    peaks = {mode: backward_peak(mode) for mode in MODES}
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    # selective keeps only the matmul and attention outputs: a real part of what none keeps is gone
    assert peaks["selective"] < 0.85 * peaks["none"]


@pytest.mark.slow
def test_selective_checkpointing_compiles_and_keeps_its_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled blocks (``train.compile``): the same loss and gradients as eager without checkpointing, and the
    policy decided the compiled graph's recompute (it is consulted while the graph is traced)."""
    import ddptrain.models.checkpointing as checkpointing
    from ddptrain.parallel.compile import compile_blocks

    consulted = Counter[str]()
    policy = checkpointing.save_matmuls

    def counted(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        consulted[op.name()] += 1
        return policy(ctx, op, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "save_matmuls", counted)
    torch._dynamo.reset()
    eager = step(lora_model("llama", "none"))
    model = lora_model("llama", "selective")
    compile_blocks(model)
    compiled = step(model)
    assert compiled[0] == pytest.approx(eager[0].item(), rel=1e-5)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the blocks ran compiled
    assert consulted["aten::mm"] > 0 and consulted["aten::mul"] + consulted["aten::mul.Tensor"] > 0


# The attention kernels a GPU runs, by the names their ops carry there: SDPA's flash, memory-efficient and cuDNN
# kernels, and flash-attn's (registered on this CPU by the twin, under its own names). Named here, not taken from
# the policy: a typo in the policy's set would make selective checkpointing recompute them, silently, on a GPU only.
GPU_ATTENTION = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_cudnn_attention", "flash_attn::_flash_attn_forward",
                 "flash_attn::_flash_attn_varlen_forward"}


def _op(name: str) -> Any:
    """The op a qualified name names (its default overload, whose ``name()`` the policy compares)."""
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op).default


def test_every_op_the_selective_policy_keeps_exists_and_the_gpu_attention_kernels_are_among_them() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    import tests.helpers.flash_attn_twin  # noqa: F401  (flash-attn's ops, as the package registers them)
    from ddptrain.models.checkpointing import SAVED_OPS, save_matmuls
    from ddptrain.models.lora import quiet_bitsandbytes

    quiet_bitsandbytes()
    import bitsandbytes  # noqa: F401  (registers bitsandbytes::gemm_4bit)

    missing = []
    for name in sorted(SAVED_OPS):
        try:
            assert _op(name).name() == name
        except AttributeError:
            missing.append(name)
    assert missing == [], f"the policy names ops that do not exist: {missing}"
    for name in sorted(GPU_ATTENTION | MATMULS):
        assert save_matmuls(None, _op(name)) == CheckpointPolicy.MUST_SAVE, name


def _flash_step(mode: str, twin: Any) -> tuple[float, int]:
    """A 2-block Llama on FlashAttention-2's varlen kernel (the twin), one packed micro batch forward and backward in
    bf16: the loss and how many times the forward kernel ran."""
    from ddptrain.config.choices import Precision
    from ddptrain.data.packing import COUNTS, PackCollate
    from ddptrain.models.attention import use_varlen_attention

    cfg = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, activation_checkpointing=mode)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    assert use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    model = prepare_for_finetuning(model, cfg).train()
    g = torch.Generator().manual_seed(2)
    examples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, VOCAB, (4, 12), generator=g).tolist()]
    batch = {k: v for k, v in PackCollate(pad_id=0, seq_len=24)(examples).items() if k not in COUNTS}
    twin.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    assert twin.backward == cfg.num_layers
    return loss.item(), twin.varlen


def test_selective_checkpointing_keeps_flash_attentions_output_as_on_a_gpu_and_full_recomputes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flash-attn's kernel is one op to the policy (the twin registers it as flash-attn does): selective
    checkpointing keeps its output, so the kernel runs once per block, as without checkpointing; full checkpointing
    runs it again in backward."""
    from tests.helpers.flash_attn_twin import install

    twin = install(monkeypatch)
    ran = {mode: _flash_step(mode, twin) for mode in MODES}
    assert {mode: kernels for mode, (_, kernels) in ran.items()} == {"none": 2, "full": 4, "selective": 2}
    for mode in ("full", "selective"):  # the same loss, to bf16's rounding
        assert ran[mode][0] == pytest.approx(ran["none"][0], rel=1e-4)


def _autograd_nodes(tensor: torch.Tensor) -> Counter[str]:
    """The autograd graph behind ``tensor``, node type by node type."""
    seen, stack, kinds = set(), [tensor.grad_fn], Counter[str]()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds[type(node).__name__] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return kinds


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_reentrant_true_checkpoints_every_block_with_torchs_reentrant_variant(reentrant: bool) -> None:
    """``model.checkpoint_reentrant=true`` takes effect: each block's recompute is torch's reentrant
    ``CheckpointFunction`` (one node per block in the autograd graph); false leaves none."""
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, activation_checkpointing="full",  # type: ignore[arg-type]
                      checkpoint_reentrant=reentrant)
    torch.manual_seed(0)
    model = prepare_for_finetuning(build_model(cfg, VOCAB), cfg).train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert _autograd_nodes(loss)["CheckpointFunctionBackward"] == (cfg.num_layers if reentrant else 0)
    loss.backward()


def test_the_deprecated_key_maps_to_the_new_one_and_a_contradiction_names_both() -> None:
    assert ModelConfig(gradient_checkpointing=True).activation_checkpointing == "full"
    assert ModelConfig(gradient_checkpointing=False).activation_checkpointing == "none"
    assert ModelConfig(gradient_checkpointing=True, activation_checkpointing="full").activation_checkpointing == "full"  # type: ignore[arg-type]
    assert ModelConfig().activation_checkpointing == "none"
    for old, new in ((True, "selective"), (False, "full"), (False, "selective")):
        with pytest.raises(ConfigError) as err:
            ModelConfig(gradient_checkpointing=old, activation_checkpointing=new)  # type: ignore[arg-type]
        message = str(err.value)
        assert "model.gradient_checkpointing" in message and f"model.activation_checkpointing={new}" in message
        assert "\n" not in message


@pytest.mark.slow
def test_a_run_with_the_deprecated_key_says_so_once_and_checkpoints(tmp_path: Path) -> None:
    result = run_cli([*TINY_RUN_ARGS, "model.gradient_checkpointing=true", f"hydra.run.dir={tmp_path / 'run'}"],
                     cwd=tmp_path, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    line = ("model.gradient_checkpointing=true is deprecated: it means model.activation_checkpointing=full; "
            "set that key instead")
    assert result.stderr.count(line) == 1
    assert "activation_checkpointing: full" in (tmp_path / "run" / "config.yaml").read_text()
