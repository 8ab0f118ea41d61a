"""Packed prompt/completion micro batches: the gradients of the padded path, no attention across examples,
throughput and padding counted from real tokens, and the same per-step loss on any world size."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config

from ddptrain.config.schema import LoraSettings, ModelConfig
from ddptrain.data import build_token_data
from ddptrain.data.instruct import PadCollate, generated_instructions
from ddptrain.data.packing import COUNTS, REAL_TOKENS, PackCollate, best_fit_decreasing
from ddptrain.data.tokenizer import train_bpe
from ddptrain.data.types import IGNORE
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.models.packed_attention import check_packed_attention, leak_share
from ddptrain.step.compute import accumulate_gradients
from ddptrain.step.weighting import TOKEN_MEAN_LOSS
from tests.helpers.dist import run_distributed
from tests.helpers.runs import make_config, train_each

VOCAB, SEQ_LEN, MBS, ACCUM = 384, 40, 4, 2
# (prompt, completion) lengths: most examples short, a few near seq_len (the skew that makes padding costly)
LENGTHS = [(3, 2), (4, 30), (2, 5), (3, 3), (5, 33), (2, 4), (3, 6), (2, 1)]
ARCHS = {
    "llama": LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128),
    "qwen3": Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128),
    "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny "pretrained" model per architecture, saved with save_pretrained (as a user brings one)."""
    out = {}
    for arch, config in ARCHS.items():
        out[arch] = tmp_path_factory.mktemp(arch)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out[arch])
    return out


def _examples() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for prompt, completion in LENGTHS:
        ids = torch.randint(0, VOCAB, (prompt + completion,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return rows


def _micro_batches(collate: Any) -> list[dict[str, torch.Tensor]]:
    rows = _examples()
    batches = [collate(rows[i * MBS : (i + 1) * MBS]) for i in range(ACCUM)]
    return [{k: v for k, v in b.items() if k not in COUNTS} for b in batches]


def _adapted(path: Path, checkpointing: bool) -> torch.nn.Module:
    cfg = ModelConfig(pretrained=str(path), activation_checkpointing="full" if checkpointing else "none",
                      lora=LoraSettings(enabled=True, r=4, alpha=8.0))
    torch.manual_seed(1)
    model = prepare_for_finetuning(build_model(cfg, VOCAB), cfg)
    with torch.no_grad():  # LoRA's B starts at zero: set it at random so that A has a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.train()  # from_pretrained returns eval mode, where checkpointing would not run
    return model


def _grads(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    loss = accumulate_gradients(model, iter(batches), ACCUM, lambda _: nullcontext(), nullcontext(),
                                TOKEN_MEAN_LOSS)
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_best_fit_decreasing_puts_each_example_in_the_fullest_row_it_fits() -> None:
    assert best_fit_decreasing([30, 5, 33, 4, 6], 40) == [[2, 4], [0, 1, 3]]
    assert sorted(i for row in best_fit_decreasing([9] * 7, 20) for i in row) == list(range(7))
    with pytest.raises(ValueError, match="exceeds the row capacity"):
        best_fit_decreasing([41], 40)


def test_packed_rows_restart_positions_and_carry_no_loss_on_prompts_or_first_tokens() -> None:
    rows = _examples()[:4]  # 5, 34, 7 and 6 tokens: rows of 40 hold [34 + 6] and [7 + 5]
    batch = PackCollate(pad_id=0, seq_len=SEQ_LEN)(rows)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (2, 40) and int(batch[REAL_TOKENS]) == 52
    assert batch["position_ids"][0].tolist() == [*range(34), *range(6)]
    assert batch["position_ids"][1].tolist() == [*range(7), *range(5), *range(28)]  # the padding tail: own segment
    assert batch["labels"][0, 34:].tolist() == [IGNORE] * 3 + rows[3]["input_ids"][3:]  # 2nd example: 3 + 3
    assert (batch["labels"][1, 12:] == IGNORE).all()
    padded, packed = PadCollate(0)(rows), batch
    assert (padded["labels"][:, 1:] != IGNORE).sum() == (packed["labels"][:, 1:] != IGNORE).sum()
    no_prompt = [{"input_ids": [7, 8, 9], "labels": [7, 8, 9]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    assert PackCollate(pad_id=0, seq_len=8)(no_prompt)["labels"].tolist() == [[IGNORE, 8, 9, IGNORE, 5]]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["lora", "lora+checkpointing"])
def test_packed_gradients_equal_the_padded_ones(pretrained: dict[str, Path], arch: str, checkpointing: bool) -> None:
    padded = _micro_batches(PadCollate(pad_id=0))
    packed = _micro_batches(PackCollate(pad_id=0, seq_len=SEQ_LEN))
    assert [len(b["input_ids"]) for b in packed] == [2, 2]  # packing was on: 4 examples in 2 rows per micro batch
    assert all("attention_mask" not in b for b in packed)
    model = _adapted(pretrained[arch], checkpointing)
    assert model.training and model.base_model.model.is_gradient_checkpointing == checkpointing
    loss_padded, expected = _grads(model, padded)
    model.zero_grad(set_to_none=True)
    loss_packed, got = _grads(model, packed)
    assert len(expected) > 0 and expected.keys() == got.keys()
    assert loss_packed == pytest.approx(loss_padded, abs=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _saved_masks(model: torch.nn.Module, batch: dict[str, Any], dtype: torch.dtype | None) -> tuple[int, torch.Tensor]:
    """One training forward: how many distinct ``[rows, 1, T, T]`` storages autograd saved for backward (the
    attention masks SDPA keeps), and the loss."""
    rows, length = batch["input_ids"].shape
    storages: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) == (rows, 1, length, length):
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model(**batch, use_cache=False).loss
    return len(storages), loss.detach()


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_saves_one_attention_mask_per_micro_batch_not_one_per_layer(
    layout: str, dtype: torch.dtype | None
) -> None:
    """SDPA's backward saves the mask it was given; a bool mask (or a float one in another dtype) is converted in
    every layer, so 4 layers saved 4 masks. The ready mask is additive, in the attention's dtype, built once per
    micro batch: 4 layers save 1, and the loss is transformers' own."""
    from ddptrain.models.attention import ready_attention_masks

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    own = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ready = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ready.load_state_dict(own.state_dict())
    assert ready_attention_masks(ready)
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": ids, "labels": ids}
                for ids in (torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (11, 9, 7, 13))]
    collate = PackCollate(pad_id=0, seq_len=20) if layout == "packed" else PadCollate(pad_id=0)
    batch = {k: v for k, v in collate(examples).items() if k not in COUNTS}
    assert batch["input_ids"].shape[1] != config.hidden_size // config.num_attention_heads  # no other [.., T, T]
    masks, loss = _saved_masks(ready, batch, dtype)
    assert masks == 1
    own_masks, own_loss = _saved_masks(own, batch, dtype)
    assert own_masks == config.num_hidden_layers  # transformers' bool mask, converted in every layer
    assert loss.item() == pytest.approx(own_loss.item(), rel=1e-6 if dtype is None else 1e-3)


class _Forcing(torch.nn.Module):
    """A model whose forward ignores the caller on one argument: ``use_cache=True`` or an all-ones 2-D mask."""

    def __init__(self, model: torch.nn.Module, what: str) -> None:
        super().__init__()
        self.model, self.what, self.config = model, what, model.config

    def forward(self, **kwargs: Any) -> Any:
        if self.what == "use_cache":
            kwargs["use_cache"] = True
        else:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        return self.model(**kwargs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_cache_or_a_2d_mask_lets_packed_examples_attend_to_each_other_and_is_refused(
    pretrained: dict[str, Path], arch: str
) -> None:
    """The two silent traps of padding-free packing in transformers, measured, and the check that catches them."""
    model = AutoModelForCausalLM.from_pretrained(pretrained[arch]).train()
    assert leak_share(model, VOCAB) < 1e-4 and model.training  # kept apart; the check restores training mode
    check_packed_attention(model, VOCAB)
    for what in ("use_cache", "mask"):
        leaking = _Forcing(model, what)
        # An unseparated row also moves the second example's positions; the leak alone is a large share of that
        # (0.38 for GPT-2's learned positions here, near 1 with rotary ones), the refusal's threshold a small one.
        assert leak_share(leaking, VOCAB) > 0.2, what
        with pytest.raises(ConfigError, match=r"^data\.packing=true: .*set data\.packing=false$"):
            check_packed_attention(leaking, VOCAB)


@pytest.fixture(scope="module")
def tokenized_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pretrained Qwen3 with its tokenizer, for runs through the training loop."""
    out = tmp_path_factory.mktemp("qwen3-tok")
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(400)], 320)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _run(base: Path) -> dict[str, Any]:
    return {
        "model": {"pretrained": str(base), "lora": {"enabled": True, "r": 4, "alpha": 8.0}},
        "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(base), "num_samples": 200,
                 "seq_len": 40, "global_batch_size": 8, "micro_batch_size": 8},
        "train": {"steps": 3, "log_every": 1, "eval_every": 3}, "optim": {"lr": 1e-2, "warmup_steps": 0},
    }


@pytest.fixture(scope="module")
def world_runs(tokenized_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, bool], list]:
    """(world size, packing) -> metrics: 1 rank x micro batch 8, and 2 ranks x micro batch 2 x accumulation 2."""
    tmp = str(tmp_path_factory.mktemp("world"))
    variants = [{"data": {"packing": packing, "shuffle": False}} for packing in (True, False)]
    one = run_distributed(train_each, 1, tmp, _run(tokenized_base), variants, timeout=300)[0]
    two_rank = {**_run(tokenized_base)}
    two_rank["data"] = {**two_rank["data"], "micro_batch_size": 2, "grad_accum": 2}
    two = run_distributed(train_each, 2, tmp, two_rank, variants, timeout=300)[0]
    return {(1, True): one[0]["metrics"], (1, False): one[1]["metrics"],
            (2, True): two[0]["metrics"], (2, False): two[1]["metrics"]}


def test_one_rank_and_two_ranks_with_accumulation_log_the_same_loss_packed_or_padded(world_runs: dict) -> None:
    losses = {key: [m["loss"] for m in metrics] for key, metrics in world_runs.items()}
    assert len(losses[(1, True)]) == 3
    for packing in (True, False):
        assert losses[(2, packing)] == pytest.approx(losses[(1, packing)], abs=1e-5)
    assert losses[(1, True)] == pytest.approx(losses[(1, False)], abs=1e-4)  # packed = padded, step by step
    assert world_runs[(1, True)][-1]["val_loss"] == pytest.approx(world_runs[(1, False)][-1]["val_loss"], abs=1e-4)


def test_throughput_counts_the_real_tokens_of_each_step_and_padding_is_logged(
    world_runs: dict, tokenized_base: Path, tmp_path: Path
) -> None:
    cfg = make_config(str(tmp_path), _run(tokenized_base))
    train = build_token_data(cfg.data).train  # shuffle off: step s trains on examples 8(s-1) .. 8s-1
    lengths = [len(ids) for ids in train["input_ids"]]
    for world, mbs in ((1, 8), (2, 2)):
        for packing, collate in ((True, PackCollate(0, cfg.data.seq_len)), (False, PadCollate(0))):
            metrics = world_runs[(world, packing)]
            for m in metrics:
                step = range(8 * (m["step"] - 1), 8 * m["step"])
                real = sum(lengths[i] for i in step)
                assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(real, rel=1e-9)
                assert m["tokens_per_s_per_rank"] * world == pytest.approx(m["tokens_per_s"])
                # micro batches as drawn: rank r takes every world-th example of the step, mbs at a time
                shards = [[train[i] for i in step[r::world]] for r in range(world)]
                computed = sum(collate(shard[j : j + mbs])["input_ids"].numel()
                               for shard in shards for j in range(0, len(shard), mbs))
                assert m["padding_pct"] == pytest.approx(100 * (1 - real / computed))
                assert m["tokens_seen"] == sum(lengths[: 8 * m["step"]])
    assert world_runs[(1, True)][0]["padding_pct"] < world_runs[(1, False)][0]["padding_pct"]


def test_each_step_logs_the_real_tokens_per_sequence_and_attention_over_each_example_not_each_row(
    world_runs: dict, tokenized_base: Path, tmp_path: Path
) -> None:
    cfg = make_config(str(tmp_path), _run(tokenized_base))
    lengths = [len(ids) for ids in build_token_data(cfg.data).train["input_ids"]]
    for key, metrics in world_runs.items():
        for m in metrics:
            step = lengths[8 * (m["step"] - 1) : 8 * m["step"]]  # shuffle off: step s trains on these 8 examples
            assert m["tokens_per_sequence"] == pytest.approx(sum(step) / 8), key
            assert m["attended_tokens"] == pytest.approx(sum(n * n for n in step) / sum(step)), key
            assert m["attended_tokens"] < cfg.data.seq_len  # packed rows of up to seq_len: fewer pairs than seq_len²


def _train_on_an_attention_that_ignores_the_mask(rank: int, world_size: int, tmp: str, base: dict,
                                                variants: list[dict]) -> list[str | None]:
    """Each variant trained with sdpa replaced by causal attention over the whole row, ignoring any mask (as
    FlashAttention-2 runs several packed rows): the one-line error each run ended with, None when it trained."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def whole_row(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register("sdpa", whole_row)  # this forked rank only
    ended: list[str | None] = []
    for variant in variants:
        try:
            train_each(rank, world_size, tmp, base, [variant])
            ended.append(None)
        except ConfigError as exc:
            ended.append(str(exc))
    return ended


def test_a_packed_run_on_attention_that_lets_examples_see_each_other_is_refused_on_every_rank(
    tokenized_base: Path, tmp_path: Path
) -> None:
    """Through the real loop: packing on such an attention is refused at start-up with one line naming
    data.packing; the same model trains padded (its causal rows never reach a pad), so the refusal is the leak."""
    run = _run(tokenized_base)
    base = {**run, "data": {**run["data"], "micro_batch_size": 4}, "train": {"steps": 1, "log_every": 1,
                                                                             "eval_every": 0}}
    variants = [{"data": {"packing": True}}, {"data": {"packing": False}}]
    ranks = run_distributed(_train_on_an_attention_that_ignores_the_mask, 2, str(tmp_path), base, variants,
                            timeout=300)
    for rank, (packed, padded) in enumerate(ranks):
        assert packed is not None and packed.startswith("data.packing=true") and "\n" not in packed, (rank, packed)
        assert "data.packing=false" in packed, (rank, packed)
        assert padded is None, (rank, padded)


def test_packed_rows_take_flashattention_varlen_only_on_cuda_with_flash_attn_in_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA with ``flash_attn`` installed and the attention in bf16/fp16 (autocast or half weights), packed
    prompt/completion rows switch to FlashAttention-2 (varlen kernels from the collate's cu_seq_lens); on CPU,
    without the package, or in fp32 (flash-attn refuses it), they keep sdpa's block-diagonal mask."""
    from ddptrain.config.choices import Precision
    from ddptrain.models import attention
    from tests.helpers.fake_cuda import H100, fake_cuda

    fake_cuda(monkeypatch, H100)  # an Ampere-or-newer GPU: its capability is no reason to refuse (test_gpu_path.py)

    class Model:
        def __init__(self, dtype: torch.dtype) -> None:
            self.implementations: list[str] = []
            self.dtype = dtype

        def set_attn_implementation(self, name: str) -> None:
            self.implementations.append(name)

    fp32, bf16 = torch.float32, torch.bfloat16
    for device, installed, precision, dtype, expected in [
        ("cuda", True, Precision.bf16, fp32, ["flash_attention_2"]),
        ("cuda", True, Precision.fp16, fp32, ["flash_attention_2"]),
        ("cuda", True, Precision.fp32, bf16, ["flash_attention_2"]), ("cuda", True, Precision.fp32, fp32, []),
        ("cuda", False, Precision.bf16, fp32, []), ("cpu", True, Precision.bf16, fp32, []),
    ]:
        monkeypatch.setattr(attention, "is_flash_attn_2_available", lambda installed=installed: installed)
        model = Model(dtype)
        switched = attention.use_varlen_attention(model, torch.device(device), precision)  # type: ignore[arg-type]
        assert switched is bool(expected)
        assert model.implementations == expected
