"""FlashAttention-2 for packed rows, run on CPU through transformers' real FA2 integration and the flash-attn twin
(``tests/helpers/flash_attn_twin.py``): packed examples stay apart in any number of rows, the start-up check
catches a leak, fp32 keeps sdpa, and sdpa's packed path reads nothing back from the device."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from ddptrain.config.choices import Precision
from ddptrain.data.packing import COUNTS, VARLEN_KEYS, PackCollate, to_device
from ddptrain.errors import ConfigError
from ddptrain.models.attention import block_causal_mask, mask_packed_rows, use_varlen_attention
from ddptrain.models.packed_attention import check_packed_attention, leak_share
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
    assert type(longest) is int and longest == 9  # a Python int: no read back in any layer
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
    from ddptrain.train.step import accumulate_gradients
    from ddptrain.train.weighting import TOKEN_MEAN_LOSS

    cfg = ModelConfig(pretrained=str(path), lora=LoraSettings(enabled=True, r=4, alpha=8.0))
    torch.manual_seed(1)
    model = build_model(cfg, VOCAB)
    assert not flash or use_varlen_attention(model, torch.device("cpu"), Precision.bf16)
    model = prepare_for_finetuning(model, cfg)
    with torch.no_grad():  # LoRA's B starts at zero: set it at random so that A has a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert flash or mask_packed_rows(model)  # on the adapted model, as the loop installs it
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
    row = torch.nn.functional.scaled_dot_product_attention(
        q[1:].transpose(1, 2), k[1:].transpose(1, 2), v[1:].transpose(1, 2), is_causal=True).transpose(1, 2)
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
    assert mask_packed_rows(model)
    ready, reads = forward()
    assert reads == []
    torch.testing.assert_close(ready, own, rtol=0, atol=1e-5)
    alone = model(**_inputs(PackCollate(0, 16)([_examples()[1]])), use_cache=False).logits[0]
    torch.testing.assert_close(ready[0, 9:16], alone, rtol=0, atol=1e-5)  # the second example saw only itself


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
    assert not mask_packed_rows(eager)  # eager wants an additive mask: transformers builds its own


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
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node=2", str(script), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.packing: FlashAttention-2 varlen kernels for the packed rows" in proc.stderr + proc.stdout
    for rank in (0, 1):
        calls = json.loads((report / f"rank{rank}.json").read_text())
        assert calls["varlen"] > 0 and calls["dense"] == 0, calls
        assert calls["most_segments"] >= 4 and calls["int_lengths"], calls  # several rows of several examples


def test_a_packed_batch_carries_the_varlen_arguments_and_moves_them_once() -> None:
    batch = PackCollate(pad_id=0, seq_len=16)(_examples())
    assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"] and batch["max_length_q"] == batch["max_length_k"] == 9
    moved = to_device(batch, torch.device("meta"))
    assert moved["cu_seq_lens_q"].is_meta and moved["cu_seq_lens_q"] is moved["cu_seq_lens_k"]
    assert moved["max_length_q"] == 9 and moved["input_ids"].is_meta
