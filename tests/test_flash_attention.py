"""FlashAttention-2 for packed rows, run on CPU through transformers' real FA2 integration and the flash-attn twin
(``tests/helpers/flash_attn_twin.py``): packed examples stay apart in any number of rows, the start-up check
catches a leak, fp32 keeps sdpa, and sdpa's packed path reads nothing back from the device."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from ddptrain.config.choices import Precision
from ddptrain.data.packing import COUNTS, VARLEN_KEYS, PackCollate, to_device
from ddptrain.errors import ConfigError
from ddptrain.models.attention import (
    additive_mask,
    block_causal_mask,
    ready_attention_masks,
    use_varlen_attention,
)
from ddptrain.models.packed_attention import check_packed_attention, leak_share
from tests.helpers import procs
from tests.helpers.dist import run_distributed
from tests.helpers.flash_attn_twin import Calls, install
from tests.helpers.runs import Overrides, train_each

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
    return {k: v for k, v in batch.items() if k not in (*COUNTS, "labels")}


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
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 16, 24, 30, 32]  # the tail of 2: a segment of its own
    assert longest == 9 and twin.read_back == 0  # a Python int: no read back in any layer
    starts = {0: 0, 1: 9, 2: 0, 3: 8}
    rows = {0: 0, 1: 0, 2: 1, 3: 1}
    worst = 0.0
    for i, example in enumerate(examples):
        alone = _logits(model, collate([example]))[0]
        n = LENGTHS[i]
        worst = max(worst, (got[rows[i], starts[i] : starts[i] + n] - alone).abs().max().item())
    assert worst < 0.01, f"packed examples' logits moved by {worst:.3f} from running each alone"


def _lora_grads(path: Path, flash: bool, batches: list[dict[str, Any]]) -> torch.Tensor:
    """LoRA gradients of two micro batches in bf16 autocast, token-weighted as the loop trains prompt/completion."""
    from contextlib import nullcontext

    from ddptrain.config.schema import LoraSettings, ModelConfig
    from ddptrain.models import build_model
    from ddptrain.models.lora import prepare_for_finetuning
    from ddptrain.step.compute import accumulate_gradients
    from ddptrain.step.weighting import TOKEN_MEAN_LOSS

    cfg = ModelConfig(pretrained=str(path), lora=LoraSettings(enabled=True, r=4, alpha=8.0))
    torch.manual_seed(1)
    model = build_model(cfg, VOCAB)
    assert not flash or use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    model = prepare_for_finetuning(model, cfg)
    with torch.no_grad():  # LoRA's B starts at zero: set it at random so that A has a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert flash or ready_attention_masks(model)  # on the adapted model, as the loop installs it
    model.train()
    accumulate_gradients(model, iter(batches), len(batches), lambda _: nullcontext(),
                         torch.autocast("cpu", dtype=torch.bfloat16), TOKEN_MEAN_LOSS)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_lora_gradients_through_flash_attention_on_packed_rows_equal_the_padded_ones_in_bf16(
    arch: str, twin: Calls, tmp_path: Path
) -> None:
    """Packed fine-tuning through the twin: two micro batches of four examples, packed into two rows each; the
    gradients equal the padded batches' (sdpa) within bf16's rounding (measured: under 1% of the largest), while
    FA2 without the varlen arguments (causal flash per row) moves them by about half of it."""
    from ddptrain.data.instruct import PadCollate
    from ddptrain.data.types import IGNORE

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(ARCHS[arch]).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(5)
    rows = []
    for prompt, completion in [(3, 2), (4, 10), (2, 5), (3, 3), (5, 11), (2, 4), (3, 6), (2, 1)]:
        ids = torch.randint(1, VOCAB, (prompt + completion,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})

    def batches(collate: Any, drop: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        return [{k: v for k, v in collate(rows[i : i + 4]).items() if k not in (*COUNTS, *drop)}
                for i in (0, 4)]

    packed = batches(PackCollate(pad_id=0, seq_len=20))
    assert [len(b["input_ids"]) for b in packed] == [2, 2]
    padded = _lora_grads(tmp_path, False, batches(PadCollate(0)))
    flash = _lora_grads(tmp_path, True, packed)
    assert twin.varlen > 0 and twin.dense == 0
    assert (flash - padded).abs().max() < 0.02 * padded.abs().max()
    per_row = _lora_grads(tmp_path, True, batches(PackCollate(pad_id=0, seq_len=20), VARLEN_KEYS))
    assert (per_row - padded).abs().max() > 0.2 * padded.abs().max()


def test_the_twin_refuses_fp32_and_computes_per_row_or_per_cu_seqlens_segment(twin: Calls) -> None:
    """The twin itself: flash-attn's refusals, the dense kernel per row, the varlen kernel within segments."""
    from tests.helpers.flash_attn_twin import REFUSAL, flash_attn_func, flash_attn_varlen_func

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match=f"^{REFUSAL}$"):
        flash_attn_func(q.float(), k.float(), v.float(), causal=True)
    dense = flash_attn_func(q, k, v, causal=True)
    row = torch.nn.functional.scaled_dot_product_attention(  # in fp32, rounded once: the kernel accumulates in fp32
        *(t[1:].float().transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2).to(torch.bfloat16)
    torch.testing.assert_close(dense[1:], row)
    cu = torch.tensor([0, 3, 5, 10], dtype=torch.int32)  # the two rows flattened: segments of 3, 2 and 5
    flat = [t.reshape(10, 4, 8) for t in (q, k, v)]
    varlen = flash_attn_varlen_func(*flat, cu, cu, 5, 5, causal=True)
    for a, b in ((0, 3), (3, 5), (5, 10)):
        alone = flash_attn_func(*(t[None, a:b] for t in flat), causal=True)[0]
        torch.testing.assert_close(varlen[a:b], alone, rtol=1.6e-2, atol=4e-3)  # bf16: a rounding apart
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        flash_attn_varlen_func(*flat, cu.long(), cu, 5, 5, causal=True)
    assert (twin.dense, twin.varlen) == (4, 1)  # refused calls computed nothing


def _varlen_args(dim: int = 8, kv_heads: int = 2) -> dict[str, Any]:
    """Two rows of 5 flattened into segments of 3, 2 and 5; 4 query heads over ``kv_heads`` key/value heads."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, dim, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(10, kv_heads, dim, generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 3, 5, 10], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu.clone(), "max_seqlen_q": 5,
            "max_seqlen_k": 5, "causal": True}


def _offsets(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


REFUSED: dict[str, tuple[dict[str, Any], str]] = {  # what flash-attn's checks refuse, then what its kernel trusts
    "fp32": ({"dtype": torch.float32}, r"^FlashAttention only support fp16 and bf16 data type$"),
    "fp16 values beside bf16 queries": ({"v_dtype": torch.float16}, "query and value must have the same dtype"),
    "head dim 264": ({"dim": 264}, "head dimension at most 256"),
    "3 key/value heads for 4 query heads": ({"kv_heads": 3}, "must divide number of heads in query"),
    "int64 offsets": ({"cu_seqlens_q": _offsets(0, 3, 5, 10).long()}, "cu_seqlens_q must have dtype int32"),
    "offsets that go down": ({"cu_seqlens_k": _offsets(0, 5, 3, 10)}, "cu_seqlens_k must start at 0 and never go down"),
    "offsets not from 0": ({"cu_seqlens_q": _offsets(1, 3, 5, 10)}, "cu_seqlens_q must start at 0"),
    "a last offset short of the tokens": ({"cu_seqlens_q": _offsets(0, 3, 5, 9)}, "ends at 9, not at the 10 tokens"),
    "a maximum length below the longest segment": ({"max_seqlen_q": 4}, "max_seqlen 4 is below the longest segment"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_twin_refuses_what_flash_attn_refuses_and_what_its_kernel_trusts(case: str, twin: Calls) -> None:
    """The real kernel computes wrong results, silently, from offsets it trusts; the twin refuses them so that a
    test catches the caller. A refused call computes nothing."""
    from tests.helpers.flash_attn_twin import flash_attn_varlen_func

    change, message = REFUSED[case]
    args = _varlen_args(change.pop("dim", 8), change.pop("kv_heads", 2))
    dtype = change.pop("dtype", None)
    if dtype is not None:
        args.update({name: args[name].to(dtype) for name in "qkv"})
    if "v_dtype" in change:
        args["v"] = args["v"].to(change.pop("v_dtype"))
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        flash_attn_varlen_func(**args)
    assert twin.varlen == 0
    flash_attn_varlen_func(**_varlen_args())  # the same call, well-formed, runs
    assert twin.varlen == 1


def test_the_twin_refuses_a_gpu_older_than_ampere_and_takes_the_capability_torch_cuda_reports(
    twin: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers.flash_attn_twin import PRE_AMPERE, device_capability, flash_attn_func, flash_attn_varlen_func

    assert device_capability() == (9, 0)  # a CPU-only torch has no device to ask: the twin stands in for an H100
    args = _varlen_args()
    dense = [t.reshape(2, 5, -1, 8) for t in (args["q"], args["k"], args["v"])]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))  # a T4
    with pytest.raises(RuntimeError, match=f"^{PRE_AMPERE}$"):
        flash_attn_varlen_func(**args)
    with pytest.raises(RuntimeError, match=f"^{PRE_AMPERE}$"):
        flash_attn_func(*dense, causal=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # an A100
    flash_attn_varlen_func(**args)
    assert (twin.varlen, twin.dense) == (1, 0)


def test_the_twins_backward_kernels_give_sdpas_gradients_with_grouped_query_heads(twin: Calls) -> None:
    """Autograd does not run inside a custom op, so the twin's backward differentiates by hand: its gradients are
    SDPA's, per row and per segment, for 4 query heads over 2 key/value heads and a head dim of 12 (padded to
    16 around the kernels, as flash-attn pads it)."""
    from tests.helpers.flash_attn_twin import flash_attn_func, flash_attn_varlen_func

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 12, generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 5, 2, 12, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    grad = torch.randn(2, 5, 4, 12, generator=g, dtype=torch.bfloat16)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2)

    want = torch.autograd.grad(sdpa(q, k, v), (q, k, v), grad.float())
    dense = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), grad)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)  # the same rows, flattened
    flat = flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu.clone(), 5, 5, causal=True)
    varlen = torch.autograd.grad(flat, (q, k, v), grad.flatten(0, 1))
    for got in (dense, varlen):
        for g_got, g_want in zip(got, want, strict=True):
            assert g_got.shape == g_want.shape
            torch.testing.assert_close(g_got.float(), g_want.float(), rtol=1.6e-2, atol=1e-2)  # one bf16 rounding apart
    assert (twin.dense, twin.varlen, twin.backward) == (1, 1, 2)


def test_the_twins_kernels_are_custom_ops_under_flash_attns_names_whose_fakes_match_them() -> None:
    """torch's own check of a custom op (schema, fake implementation against the kernel, shapes and strides
    included, and AOT dispatch) passes for all four, each under flash-attn 2.8's name."""
    from tests.helpers.flash_attn_twin import flash_attn_func  # noqa: F401  (registers the ops)

    ops = torch.ops.flash_attn
    a = _varlen_args()
    q, k, v, cu_q, cu_k = a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"]
    varlen = (q, k, v, cu_q, cu_k, 5, 5, 0.0, 0.35, True)
    out, lse, _, rng = ops._flash_attn_varlen_forward(*varlen)
    dense = tuple(t.reshape(2, 5, -1, 8) for t in (q, k, v))
    d_out, d_lse, _, d_rng = ops._flash_attn_forward(*dense, 0.0, 0.35, True, -1, -1, 0.0, None, False)
    checks = {
        ops._flash_attn_varlen_forward.default: varlen,
        ops._flash_attn_varlen_backward.default: (torch.randn_like(out), q, k, v, out, lse, torch.empty_like(q),
                                                  torch.empty_like(k), torch.empty_like(v), cu_q, cu_k, 5, 5, 0.0,
                                                  0.35, True, -1, -1, 0.0, None, False, rng),
        ops._flash_attn_forward.default: (*dense, 0.0, 0.35, True, -1, -1, 0.0, None, False),
        ops._flash_attn_backward.default: (torch.randn_like(d_out), *dense, d_out, d_lse,
                                           *(torch.empty_like(t) for t in dense), 0.0, 0.35, True, -1, -1, 0.0, None,
                                           False, d_rng),
    }
    for op, args in checks.items():
        assert op.name().startswith("flash_attn::_flash_attn_")
        assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}, op.name()
    assert str(ops._flash_attn_varlen_backward.default._schema).startswith(
        "flash_attn::_flash_attn_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor softmax_lse, Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv")  # writes dq, dk, dv in place


class _Ops(TorchDispatchMode):
    """Every op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names[func.name()] += 1
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_and_dynamo_see_one_opaque_op_per_call_and_dynamo_compiles_it_once(twin: Calls) -> None:
    """What a GPU shows them: a dispatch mode sees the forward and backward kernels by name and nothing inside
    them; Dynamo puts the op in one graph and reuses it call after call (a counter the twin kept in traced Python
    would be a constant Dynamo guards on: one recompile per call)."""
    from tests.helpers.flash_attn_twin import flash_attn_varlen_func

    args = _varlen_args()
    leaves = [args[name].requires_grad_() for name in "qkv"]
    with _Ops() as seen:
        flash_attn_varlen_func(**args).float().sum().backward()
    flash = {name for name in seen.names if name.startswith("flash_attn::")}
    assert flash == {"flash_attn::_flash_attn_varlen_forward", "flash_attn::_flash_attn_varlen_backward"}
    assert not {"aten::bmm", "aten::mm", "aten::_softmax", "aten::logsumexp"} & set(seen.names)  # the insides
    assert all(t.grad is not None for t in leaves)

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    compiled = torch.compile(flash_attn_varlen_func, backend=backend, fullgraph=True)
    plain = {**_varlen_args(), "causal": True}
    twin.reset()
    for _ in range(3):
        compiled(**plain)
    torch.compiler.reset()
    assert len(graphs) == 1 and twin.varlen == 3
    targets = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    op = torch.ops.flash_attn._flash_attn_varlen_forward
    assert {op, op.default} & targets  # the op itself, one node


class _WithoutVarlenArguments(torch.nn.Module):
    """A model called without the collate's varlen arguments: transformers' FA2 path then finds packed examples
    only in a single row, and runs causal flash per row otherwise (what a collate without them gave)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, **kwargs: Any) -> Any:
        return self.model(**{k: v for k, v in kwargs.items() if k not in VARLEN_KEYS})


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_startup_check_packs_two_rows_and_refuses_flash_attention_run_per_row(arch: str, twin: Calls) -> None:
    model = _model(arch).to(torch.bfloat16)
    assert use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    check_packed_attention(model, VOCAB)  # the varlen arguments given: examples kept apart
    assert twin.dense == 0 and [0, 6, 12, 18, 24] in [cu.tolist() for cu, _ in twin.segments]  # two rows of two
    twin.reset()
    per_row = _WithoutVarlenArguments(model)
    assert leak_share(per_row, VOCAB) > 0.2
    assert max(twin.rows) == 2, "the check ran a micro batch of two rows"
    with pytest.raises(ConfigError, match=r"^data\.packing=true: .*flash_attention_2.*set data\.packing=false$"):
        check_packed_attention(per_row, VOCAB)


def test_sdpa_packed_rows_read_nothing_back_with_the_ready_mask_and_match_transformers_own() -> None:
    """transformers' packed-sequence detection reads the device once per forward; the block mask built on the
    device from position_ids gives the same logits with no read (the hot-path detector, ``host_reads.py``)."""
    from tests.helpers.host_reads import HostReads

    model = _model("llama")
    batch = _inputs(PackCollate(pad_id=0, seq_len=16)(_examples()))
    device = torch.device("cpu")
    batch = to_device(batch, device)

    def forward() -> tuple[torch.Tensor, list[str]]:
        reads: list[str] = []
        with torch.no_grad(), HostReads(device, lambda name, why: reads.append(name)):
            out = model(**batch, use_cache=False).logits
        return out, reads

    own, own_reads = forward()
    assert own_reads, "transformers' own detection reads the device (the read this removes)"
    assert ready_attention_masks(model)
    ready, reads = forward()
    assert reads == []
    torch.testing.assert_close(ready, own, rtol=0, atol=1e-5)
    alone = model(**_inputs(PackCollate(0, 16)([_examples()[1]])), use_cache=False).logits[0]
    torch.testing.assert_close(ready[0, 9:16], alone, rtol=0, atol=1e-5)  # the second example saw only itself


def test_sdpa_padded_rows_read_nothing_back_with_the_ready_mask_and_give_transformers_logits() -> None:
    """A padded prompt/completion batch: transformers' SDPA path asks the device twice per forward whether the
    batch has padding at all; the ready causal-and-padding mask gives the same logits, padding positions included,
    with no read."""
    from ddptrain.data.instruct import PadCollate
    from tests.helpers.host_reads import HostReads

    model = _model("llama")
    batch = {k: v for k, v in PadCollate(0)(_examples()).items() if k != "labels"}
    assert (batch["attention_mask"] == 0).any()

    def forward() -> tuple[torch.Tensor, list[str]]:
        reads: list[str] = []
        with torch.no_grad(), HostReads(torch.device("cpu"), lambda name, why: reads.append(name)):
            out = model(**batch, use_cache=False).logits
        return out, reads

    own, own_reads = forward()
    assert own_reads, "transformers' own padding check reads the device (the read this removes)"
    assert ready_attention_masks(model)
    ready, reads = forward()
    assert reads == []
    torch.testing.assert_close(ready, own, rtol=0, atol=1e-5)


def test_flash_attention_with_the_varlen_arguments_reads_the_device_once_per_forward_not_per_layer(
    twin: Calls,
) -> None:
    """What remains on the FA2 path: transformers' mask builder still runs its packed-sequence detection (one read
    per forward, answer discarded). Without the arguments a single packed row is found per layer, from the
    position_ids: a read, a nonzero and the maximum lengths read back in every layer."""
    from tests.helpers.host_reads import HostReads

    model = _model("llama").to(torch.bfloat16)
    assert use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    device = torch.device("cpu")

    def reads(batch: dict[str, Any]) -> list[str]:
        seen: list[str] = []
        with torch.no_grad(), HostReads(device, lambda name, why: seen.append(name)):
            model(**batch, use_cache=False)
        return seen

    assert reads(_inputs(PackCollate(pad_id=0, seq_len=16)(_examples()))) == ["__bool__"]
    one_row = {k: v for k, v in _inputs(PackCollate(pad_id=0, seq_len=32)(_examples()[:3])).items()
               if k not in VARLEN_KEYS}
    per_layer = ["__bool__", "nonzero", "__int__", "__int__"]
    assert reads(one_row) == ["__bool__", *per_layer * ARCHS["llama"].num_hidden_layers]


def test_a_ready_mask_only_for_sdpa_and_the_same_segments_as_transformers_finds() -> None:
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    mask = block_causal_mask(positions)
    segments = find_packed_sequence_indices(positions)
    expected = (segments[:, :, None] == segments[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert mask.shape == (2, 1, 6, 6) and torch.equal(mask[:, 0], expected)
    eager = AutoModelForCausalLM.from_config(ARCHS["gpt2"], attn_implementation="eager")
    assert not ready_attention_masks(eager)  # eager wants an additive mask: transformers builds its own


COMPILED_LENGTHS = ([20, 5, 3, 17], [9, 7, 8, 6], [30, 2, 11, 4], [9, 7, 8, 6, 30, 31], [3, 4])  # rows: 2 1 2 3 1


def _compiled_flash_blocks(rank: int, world_size: int) -> dict[str, Any]:
    """A 12-block Llama on FlashAttention-2's varlen path (the twin), its blocks compiled by ``compile_blocks`` with
    a backend that counts the graphs Dynamo hands it; five packed micro batches of changing shape, forward and
    backward in bf16 autocast, beside an eager copy of the model."""
    import copy

    from torch._dynamo.utils import counters

    from ddptrain.parallel.compile import compile_blocks
    from tests.helpers.flash_attn_twin import Permanent

    calls = install(Permanent())
    torch.compiler.reset()
    counters.clear()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    eager = copy.deepcopy(model)
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    original = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: original(self, **{**kw, "backend": counting})  # type: ignore
    try:
        blocks = compile_blocks(model, varying_shapes=True)
    finally:
        torch.nn.Module.compile = original  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(4)
    out: dict[str, Any] = {"blocks": blocks, "graphs": [], "rows": [], "losses": [], "eager": [], "kernels": 0}
    for lengths in COMPILED_LENGTHS:
        examples = [{"input_ids": ids, "labels": ids}
                    for ids in (torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths)]
        batch = _inputs(PackCollate(pad_id=0, seq_len=32)(examples)) | {"labels": None}
        batch["labels"] = batch["input_ids"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out["eager"].append(eager(**batch, use_cache=False).loss.item())
            before = calls.varlen
            loss = model(**batch, use_cache=False).loss
            out["kernels"] += calls.varlen - before
        loss.backward()
        out["losses"].append(loss.item())
        out["graphs"].append(len(graphs))
        out["rows"].append(batch["input_ids"].shape[0])
    out.update(backward=calls.backward, breaks=sum(counters["graph_break"].values()))
    return out


@pytest.mark.slow  # Dynamo traces a 12-block model twice, forward and backward: ~40 s on a loaded 2-core machine
def test_compiled_blocks_on_flash_attention_packed_rows_share_one_graph_across_layers_and_micro_batches() -> None:
    """train.compile with FlashAttention-2's varlen kernel: transformers passes each layer's ``layer_idx`` into the
    FA2 path (one graph per layer, then eager past Dynamo's recompile limit of 8), logs from inside it (a graph
    break in every layer), and every micro batch brings new row counts, lengths, offsets and longest segment (a
    recompile each). Through ``compile_blocks``: one graph serves all 12 layers and every micro batch of several
    rows, one more the micro batches of one row (torch specializes a size of 1); no graph break; every layer ran
    the kernel, compiled, forward and backward; the eager model's losses."""
    (ran,) = run_distributed(_compiled_flash_blocks, 1, timeout=600)
    assert ran["blocks"] == 12 and ran["rows"] == [2, 1, 2, 3, 1]
    assert ran["graphs"] == [1, 2, 2, 2, 2], ran["graphs"]
    assert ran["breaks"] == 0
    assert ran["kernels"] == ran["backward"] == 12 * len(COMPILED_LENGTHS)
    assert ran["losses"] == pytest.approx(ran["eager"], rel=1e-5)


STARTUP: Overrides = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
    "data": {"source": "instructions", "format": "prompt_completion", "num_samples": 64, "seq_len": 48,
             "global_batch_size": 8, "micro_batch_size": 8},
    "train": {"steps": 2, "log_every": 1, "eval_every": 0}, "optim": {"warmup_steps": 0},
}


def _startup_runs(rank: int, world_size: int, tmp: str, tokenizer: str) -> dict[str, dict[str, Any]]:
    """GPT-2 and Llama, fp32 and bf16, trained with packing on an "H100" (the twin installed in this rank)."""
    import logging

    from tests.helpers.flash_attn_twin import Permanent

    calls = install(Permanent())
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ddptrain.models.attention")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = {}
    for arch in ARCHS:
        for precision in ("fp32", "bf16"):
            calls.reset()
            said.clear()
            variant: Overrides = {"model": {"arch": arch}, "train": {"precision": precision},
                                  "data": {**STARTUP["data"], "tokenizer": tokenizer}}
            (result,) = train_each(rank, world_size, f"{tmp}/{arch}-{precision}", STARTUP, [variant])
            out[f"{arch}-{precision}"] = {"losses": [m["loss"] for m in result["metrics"]], "said": list(said),
                                          "varlen": calls.varlen, "dense": calls.dense,
                                          "rows": max((cu.numel() for cu, _ in calls.segments), default=0)}
    return out


@pytest.fixture(scope="module")
def startup_runs(tmp_path_factory: pytest.TempPathFactory, pretrained_base: Path) -> dict[str, dict[str, Any]]:
    """Fresh models with the tiny pretrained model's tokenizer (prompt/completion data needs one)."""
    tmp = str(tmp_path_factory.mktemp("startup"))
    return run_distributed(_startup_runs, 1, tmp, str(pretrained_base), timeout=600)[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_flash_attention_in_bf16_starts_and_trains_packed_rows_through_the_varlen_kernel(
    startup_runs: dict[str, dict[str, Any]], arch: str
) -> None:
    """The start-up check runs under the run's autocast (flash-attn refuses fp32; GPT-2 has no nn.Linear for
    transformers' dtype lookup), then training takes the varlen kernel in every layer."""
    run = startup_runs[f"{arch}-bf16"]
    assert len(run["losses"]) == 2 and all(loss == loss for loss in run["losses"])
    assert run["varlen"] > 0 and run["dense"] == 0
    assert run["said"] == ["data.packing: FlashAttention-2 varlen kernels for the packed rows"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_without_half_weights_keeps_sdpa_for_packed_rows_with_one_line(
    startup_runs: dict[str, dict[str, Any]], arch: str
) -> None:
    run = startup_runs[f"{arch}-fp32"]
    assert len(run["losses"]) == 2 and all(loss == loss for loss in run["losses"])
    assert run["varlen"] == run["dense"] == 0, "flash-attn was never called"
    assert len(run["said"]) == 1 and run["said"][0].startswith("data.packing: FlashAttention-2 computes in bf16/fp16")


@pytest.mark.slow
def test_a_packed_fine_tuning_run_from_the_command_line_goes_through_flash_attentions_varlen_kernel(
    pretrained_base: Path, tmp_path: Path
) -> None:
    """Two torchrun workers on an "H100" (the twin installed by ``tests/helpers/flash_attn_cli.py``), LoRA on the
    tiny pretrained Llama, bf16, packed prompt/completion rows: every attention call is the varlen kernel."""
    import json

    from tests.helpers.cli import TORCHRUN, test_env

    report = tmp_path / "twin"
    report.mkdir()
    args = [f"model.pretrained={pretrained_base}", "model.lora.enabled=true", "data.source=instructions",
            "data.format=prompt_completion", f"data.tokenizer={pretrained_base}", "data.num_samples=96",
            "data.seq_len=48", "data.global_batch_size=16", "data.micro_batch_size=8", "train.steps=2",
            "train.log_every=1", "train.eval_every=2", "train.precision=bf16", "logger.progress=false",
            "checkpoint.export=false"]
    # PYTHONSAFEPATH: the script's folder stays off the workers' path (tests/helpers/flash_attn_cli.py)
    env = test_env(tmp_path / "cache", {"DDPTRAIN_TWIN_REPORT": str(report), "PYTHONSAFEPATH": "1"})
    script = Path(__file__).parent / "helpers" / "flash_attn_cli.py"
    proc = procs.run([*TORCHRUN, "--nproc-per-node=2", str(script), *args],
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.packing: FlashAttention-2 varlen kernels for the packed rows" in proc.stderr + proc.stdout
    for rank in (0, 1):
        calls = json.loads((report / f"rank{rank}.json").read_text())
        assert calls["varlen"] > 0 and calls["dense"] == 0, calls
        assert calls["most_segments"] >= 4 and calls["int_lengths"], calls  # several rows of several examples


def test_a_packed_batch_carries_the_varlen_arguments_as_two_tensors_and_moves_them() -> None:
    """The query and key offsets are equal but two tensors: Dynamo does not trace an autograd.Function given one
    tensor as two inputs (flash-attn's varlen function takes both), a graph break in every layer when compiled."""
    batch = PackCollate(pad_id=0, seq_len=16)(_examples())
    assert batch["cu_seq_lens_q"] is not batch["cu_seq_lens_k"]
    assert torch.equal(batch["cu_seq_lens_q"], batch["cu_seq_lens_k"])
    assert batch["max_length_q"] == batch["max_length_k"] == 9
    moved = to_device(batch, torch.device("meta"))
    assert moved["cu_seq_lens_q"].is_meta and moved["cu_seq_lens_k"].is_meta
    assert moved["max_length_q"] == 9 and moved["input_ids"].is_meta


class _MaskSeen(Exception):
    """Raised by the test's pre-hook with the mask the model would run with (the model itself does not run)."""


@pytest.mark.parametrize("rows", ["packed", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ready_mask_for_cudas_kernel_has_rows_strided_by_a_multiple_of_8(rows: str, dtype: torch.dtype) -> None:
    """The mask ``ready_attention_masks`` hands a CUDA forward (inputs on a fake ``cuda`` device: FakeTensors, so
    nothing runs) keeps each row of its storage at a multiple of 8 elements, as CUDA's memory-efficient SDPA
    kernel needs to take it without a copy, for keys that are not a multiple of 8 (6, 13); the visible part is
    the mask itself. Both the packed rows' block-diagonal mask and the padded rows' causal-and-padding one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _model("llama").to(dtype)
    assert ready_attention_masks(model)
    seen: list[torch.Tensor] = []

    def capture(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(kwargs["attention_mask"])
        raise _MaskSeen

    model.register_forward_pre_hook(capture, with_kwargs=True)  # after the ready mask's hook
    for keys in (6, 13):
        with FakeTensorMode():
            ids = torch.zeros(2, keys, dtype=torch.long, device="cuda")
            if rows == "packed":
                inputs = {"position_ids": torch.arange(keys, device="cuda").remainder(4).expand(2, keys)}
            else:
                inputs = {"attention_mask": torch.ones(2, keys, dtype=torch.long, device="cuda")}
            with pytest.raises(_MaskSeen):
                model(input_ids=ids, use_cache=False, **inputs)
        mask = seen.pop()
        assert mask.device.type == "cuda" and mask.dtype == dtype and mask.shape == (2, 1, keys, keys)
        assert mask.stride(-1) == 1 and mask.stride(-2) % 8 == 0 and mask.stride(-2) == -(-keys // 8) * 8


def test_the_additive_masks_rows_are_padded_to_the_next_multiple_of_8_for_every_key_count() -> None:
    """Each row's storage is the key count rounded up to a multiple of 8, no less (the visible part must fit) and
    no more (an aligned count gets no spare block): 1 to 17 keys, either side of 8 and 16."""
    for keys in range(1, 18):
        allowed = torch.ones(2, 1, keys, keys, dtype=torch.bool).tril()
        mask = additive_mask(allowed, torch.float32)
        assert mask.shape == (2, 1, keys, keys) and mask.stride(-2) == -(-keys // 8) * 8, keys
        assert torch.equal(mask == 0, allowed), keys
