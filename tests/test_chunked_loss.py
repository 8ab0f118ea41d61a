"""train.chunked_loss: the LM head and the cross-entropy chunk by chunk give the full-logits loss and gradients
(fp32, bf16, fp16, masks, tied heads, LoRA, DDP, ZeRO-3, token weighting across accumulation and ranks), and no
[tokens, vocab] tensor exists whole."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.config.schema import LoraSettings, ModelConfig, ParallelConfig
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.models.chunked_loss import LinearCrossEntropy, chunked_loss_refusal, use_chunked_loss
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.parallel import wrap_model
from ddptrain.train.step import accumulate_gradients
from ddptrain.train.weighting import TOKEN_MEAN_LOSS
from tests.helpers.dist import run_distributed

VOCAB, SEQ, B, CHUNK = 320, 17, 3, 7  # 3 x 16 = 48 loss positions: 7 chunks, the last one short
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, max_position_embeddings=64)


def _batch(rows: int = B, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels with -100 where a prompt or a packed example's first token would be."""
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :6] = -100
    labels[-1, 9] = -100
    return ids, labels


def _pair(cfg: ModelConfig = TINY) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: the full-logits model and one with the chunked loss."""
    torch.manual_seed(0)
    full = build_model(cfg, VOCAB, eos_id=0)
    chunked = copy.deepcopy(full)
    assert use_chunked_loss(chunked, CHUNK) == CHUNK
    return full, chunked


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, autocast=None, **kwargs
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast or nullcontext():
        out = model(input_ids=ids, labels=labels, use_cache=False, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class LargestVocabTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates (not a view) whose last dimension is the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view (the head weight transposed) holds no memory of its own
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("num_items", [None, 29.0])
def test_chunked_loss_equals_the_full_logits_loss_and_gradients_in_fp32(arch: str, num_items: float | None) -> None:
    full, chunked = _pair(replace(TINY, arch=arch))
    ids, labels = _batch()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want, want_grads = _loss_and_grads(full, ids, labels, **kwargs)
    with LargestVocabTensor() as seen:
        got, got_grads = _loss_and_grads(chunked, ids, labels, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert _rel(got_grads[name], grad) < 1e-6, name
    assert seen.largest == CHUNK * VOCAB  # on: no tensor wider than one chunk of logits
    assert chunked(input_ids=ids, labels=labels, use_cache=False).logits is None


def test_a_tied_head_gets_its_gradient_on_the_shared_embedding_weight() -> None:
    full, chunked = _pair()
    head = chunked.get_output_embeddings()
    assert head.weight is chunked.get_input_embeddings().weight
    ids, labels = _batch()
    _, want = _loss_and_grads(full, ids, labels)
    _, got = _loss_and_grads(chunked, ids, labels)
    embed_only = full.get_input_embeddings().weight.grad.clone()
    full.zero_grad()
    full.get_input_embeddings()(ids).sum().backward()  # the embedding's own share alone differs from the total
    assert _rel(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"]) < 1e-6
    assert _rel(embed_only, full.get_input_embeddings().weight.grad) > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_chunked_loss_is_as_close_to_fp32_as_the_full_logits_are(dtype: torch.dtype) -> None:
    full, chunked = _pair()
    ids, labels = _batch()
    _, exact_grads = _loss_and_grads(full, ids, labels)
    autocast = torch.autocast("cpu", dtype=dtype)
    want, want_grads = _loss_and_grads(full, ids, labels, autocast)
    got, got_grads = _loss_and_grads(chunked, ids, labels, autocast)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert abs(float(got - want)) / float(want) < tol
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        full_err, chunked_err = _rel(want_grads[name], exact_grads[name]), _rel(got_grads[name], exact_grads[name])
        assert chunked_err < max(2 * full_err, tol), (name, full_err, chunked_err)


def test_fp16_softmax_gradients_survive_the_cast_through_the_prescale() -> None:
    """Without the power-of-two prescale, fp16 softmax gradients of a large vocabulary underflow to zero."""
    torch.manual_seed(0)
    vocab, width = 40_000, 16
    hidden = torch.randn(4, width, requires_grad=True)
    weight = torch.randn(vocab, width) * 0.01
    targets = torch.tensor([1, 2, 3, 4])
    exact = LinearCrossEntropy.apply(hidden, weight, targets, 2, torch.float32)
    (grad_exact,) = torch.autograd.grad(exact, hidden)
    half = LinearCrossEntropy.apply(hidden, weight, targets, 2, torch.float16)
    (grad_half,) = torch.autograd.grad(half, hidden)
    assert _rel(grad_half, grad_exact) < 1e-2


def test_evaluation_and_logits_without_labels_are_unchanged() -> None:
    full, chunked = _pair()
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(chunked(input_ids=ids, labels=labels).loss, full(input_ids=ids, labels=labels).loss,
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(chunked(input_ids=ids).logits, full(input_ids=ids).logits)


def test_a_deep_copy_runs_its_own_weights_through_its_own_chunked_forward() -> None:
    _, chunked = _pair()
    twin = copy.deepcopy(chunked)
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2)
    ids, labels = _batch()
    with torch.no_grad():
        assert not torch.equal(twin(input_ids=ids, labels=labels).loss, chunked(input_ids=ids, labels=labels).loss)
        assert not torch.equal(twin(input_ids=ids).logits, chunked(input_ids=ids).logits)


def test_lora_trains_the_same_adapters_and_computes_no_head_gradient() -> None:
    cfg = replace(TINY, lora=LoraSettings(enabled=True, r=4, alpha=8.0))
    torch.manual_seed(0)
    full = prepare_for_finetuning(build_model(cfg, VOCAB, eos_id=0), cfg)
    for p in full.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)  # B starts at zero: give every adapter a gradient to compare
    chunked = copy.deepcopy(full)
    assert use_chunked_loss(chunked, CHUNK) == CHUNK
    ids, labels = _batch()
    want_loss, want = _loss_and_grads(full, ids, labels)
    got_loss, got = _loss_and_grads(chunked, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert want.keys() == got.keys() and all("lora_" in n for n in got)
    for name, grad in want.items():
        assert _rel(got[name], grad) < 1e-6, name
    assert chunked(input_ids=ids, labels=labels, use_cache=False).logits is None


def test_a_head_it_is_not_exact_for_keeps_the_full_logits() -> None:
    torch.manual_seed(0)
    model = build_model(TINY, VOCAB, eos_id=0)
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert "with a bias" in (chunked_loss_refusal(model) or "")
    assert use_chunked_loss(model, CHUNK) is None
    ids, labels = _batch()
    assert model(input_ids=ids, labels=labels).logits is not None


def test_a_chunk_size_below_one_is_refused_naming_the_key(compose) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"^train.loss_chunk_tokens=0: expected a positive number"):
        compose("train.loss_chunk_tokens=0")


def _grads_on_ranks(rank: int, world_size: int) -> dict[int, dict[str, torch.Tensor]]:
    """Token-weighted accumulation of two uneven micro batches per rank, chunked, under DDP and ZeRO-3."""
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = build_model(TINY, VOCAB, eos_id=0)
        assert use_chunked_loss(model, CHUNK) == CHUNK
        wrapped = wrap_model(model, ParallelConfig(zero_stage=stage, wrap_single=True), torch.device("cpu"))
        ids, labels = _batch(2 * world_size * 2)
        mine = slice(rank * 4, rank * 4 + 4)
        micro = [{"input_ids": i, "labels": lab}
                 for i, lab in zip(ids[mine].chunk(2), labels[mine].chunk(2), strict=True)]
        accumulate_gradients(wrapped.module, iter(micro), 2, wrapped.maybe_sync, nullcontext(), TOKEN_MEAN_LOSS)
        out[stage] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for n, p in model.named_parameters()}
    return out


def test_ddp_and_zero3_give_every_rank_the_single_process_full_logits_gradients() -> None:
    torch.manual_seed(0)
    reference = build_model(TINY, VOCAB, eos_id=0)
    ids, labels = _batch(8)
    tokens = (labels[:, 1:] != -100).sum()
    reference(input_ids=ids, labels=labels, num_items_in_batch=tokens).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for rank, per_stage in enumerate(run_distributed(_grads_on_ranks, 2)):
        for stage, grads in per_stage.items():
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} stage {stage} {name}")
