"""train.chunked_loss: the LM head and the cross-entropy chunk by chunk give the full-logits loss and gradients
(fp32, bf16, fp16, masks, tied heads, LoRA, DDP, ZeRO-3, token weighting across accumulation and ranks), and no
[tokens, vocab] tensor exists whole."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from ddptrain.config.schema import LoraSettings, ModelConfig, ParallelConfig
from ddptrain.data.instruct import generated_instructions
from ddptrain.data.tokenizer import train_bpe
from ddptrain.errors import ConfigError
from ddptrain.models import build_model
from ddptrain.models.chunked_loss import (
    LinearCrossEntropy,
    chunk_tokens_for,
    chunked_loss_refusal,
    linear_cross_entropy,
    use_chunked_loss,
)
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.parallel import wrap_model
from ddptrain.step.compute import accumulate_gradients
from ddptrain.step.weighting import TOKEN_MEAN_LOSS
from tests.helpers.chunks import CountedChunks, HeadTraffic, head_bytes_per_chunk, outcomes_counting_chunks
from tests.helpers.compile_backend import module_compile_backend
from tests.helpers.dist import run_distributed
from tests.helpers.runs import Overrides

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_under_autocast_the_chunked_loss_equals_the_full_logits_loss_and_is_as_close_to_fp32(dtype: torch.dtype
                                                                                              ) -> None:
    """The same autocast: the head's matmul in its dtype, one per chunk (never in fp32), the log-softmax in fp32
    (a log-softmax in bf16 moves the loss by ~1e-3 relative): the loss equals the full path's to 1e-6; the
    gradients are as close to fp32's as the full path's are."""
    full, chunked = _pair()
    ids, labels = _batch()
    _, exact_grads = _loss_and_grads(full, ids, labels)
    autocast = torch.autocast("cpu", dtype=dtype)
    want, want_grads = _loss_and_grads(full, ids, labels, autocast)
    with HeadTraffic(VOCAB, TINY.hidden_size) as traffic:
        got, got_grads = _loss_and_grads(chunked, ids, labels, autocast)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    head_matmuls = [m for m in traffic.matmuls if m[0][-1] == VOCAB]
    assert head_matmuls == [((CHUNK, VOCAB), dtype)] * 6 + [((6, VOCAB), dtype)]
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        full_err, chunked_err = _rel(want_grads[name], exact_grads[name]), _rel(got_grads[name], exact_grads[name])
        assert chunked_err < max(2 * full_err, tol), (name, full_err, chunked_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_trainable_head_in_half_precision_moves_no_more_head_bytes_per_chunk_than_in_fp32(dtype: torch.dtype
                                                                                            ) -> None:
    """The head's gradient accumulates in fp32 without a half-precision [vocab, hidden] product, its copy and its
    rescaling per chunk: bytes read and written in head-shaped tensors, per chunk, within 1.25x of fp32's."""
    head = VOCAB * TINY.hidden_size
    fp32, _ = head_bytes_per_chunk(VOCAB, TINY.hidden_size, torch.float32)
    half, _ = head_bytes_per_chunk(VOCAB, TINY.hidden_size, dtype)
    assert half <= 1.25 * fp32, f"{dtype}: {half / head:g} x V*H bytes per chunk, fp32 {fp32 / head:g} x V*H"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_backward_scales_the_kept_gradients_in_place_without_a_copy_of_the_head(dtype: torch.dtype) -> None:
    hidden = torch.randn(3 * CHUNK, TINY.hidden_size, requires_grad=True)
    weight = (torch.randn(VOCAB, TINY.hidden_size) * 0.02).requires_grad_()
    loss = LinearCrossEntropy.apply(hidden, weight, torch.randint(0, VOCAB, (3 * CHUNK,)), CHUNK, dtype)
    with HeadTraffic(VOCAB, TINY.hidden_size) as traffic:
        (loss * 3.0).backward()
    assert traffic.created == []  # the fp32 weight takes the fp32 gradient that forward kept, scaled in place
    assert weight.grad is not None and hidden.grad is not None


def test_the_head_gradient_under_autocast_is_at_least_as_close_to_fp32_as_the_full_logits_one() -> None:
    """Accumulated in fp32 from the half-precision products (the full path rounds its one product to half)."""
    torch.manual_seed(0)
    tokens, width, vocab = 96, 64, 2048
    hidden = torch.randn(1, tokens + 1, width, requires_grad=True)
    weight = (torch.randn(vocab, width) * 0.05).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens + 1))
    items = torch.tensor(float(tokens))

    def full_loss() -> torch.Tensor:
        return ForCausalLMLoss(torch.nn.functional.linear(hidden, weight), labels, vocab, items)

    def grads(loss_of, autocast) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
        with autocast:
            loss = loss_of()
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))

    exact = grads(full_loss, nullcontext())
    for dtype in (torch.bfloat16, torch.float16):
        autocast = torch.autocast("cpu", dtype=dtype)
        want = grads(full_loss, autocast)
        got = grads(lambda: linear_cross_entropy(hidden, weight, labels, items, 16), autocast)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
        for name, g, w, e in zip(("hidden", "weight"), got[1:], want[1:], exact[1:], strict=True):
            assert _rel(g, e) <= max(1.01 * _rel(w, e), 1e-6), (dtype, name, _rel(g, e), _rel(w, e))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_on_a_gpu_the_head_gradient_accumulates_in_fp32_inside_the_matmul(dtype: torch.dtype) -> None:
    """CUDA's path (the half-precision matmul writes the fp32 accumulator itself, ``addmm(out_dtype=float32)``)
    gives the loss and gradients of the CPU's path (fp32 sums of the same products) and moves 12 x V*H bytes of
    the head per chunk: the two matmuls' half-precision reads (2 + 2) and the accumulator's read and write."""
    torch.manual_seed(0)
    vocab, width = 2048, 64
    hidden, weight = torch.randn(1, 97, width), torch.randn(vocab, width) * 0.05
    labels = torch.randint(0, vocab, (1, 97))
    out = {}
    for device in ("cpu", "cuda"):
        h, w = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
        with torch.autocast(device, dtype=dtype):
            loss = linear_cross_entropy(h, w, labels.to(device), None, 16)
        out[device] = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    for name, got, want in zip(("loss", "hidden", "weight"), out["cuda"], out["cpu"], strict=True):
        assert _rel(got.cpu(), want) < 1e-2, name
    per_chunk, _ = head_bytes_per_chunk(vocab, width, dtype, device="cuda")
    assert per_chunk == 12 * vocab * width


def _first_finite_step(loss_of, hidden: torch.Tensor, weight: torch.Tensor  # type: ignore[no-untyped-def]
                       ) -> tuple[float | None, list[float]]:
    """Steps on ``loss_of(hidden, weight)`` under fp16 autocast with torch's GradScaler from its initial scale,
    2^16: the scale of the first step the scaler takes (None: it backed off 24 times, to 2^-8, and never took
    one), and the scales it tried."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.SGD([hidden, weight], lr=0.1)
    tried = []
    for _ in range(25):
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(hidden, weight)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        tried.append(scale)
        if scaler.get_scale() == scale:  # no back-off: the gradients were finite and the step was taken
            return scale, tried
    return None, tried


def test_fp16_with_a_trainable_head_takes_a_step_at_the_loss_scale_the_full_logits_recover_at() -> None:
    """Realistic magnitudes: a hidden channel at 25 (the massive activations trained LMs' final hidden states
    have) and four tokens sharing a target overflow the fp16 head-weight gradient of the full logits at the loss
    scale 2^16 (4 x 25 x 2^16 / 64 tokens > 65504); one back-off cures it. A fixed 2^10 prescale before an fp16
    head GEMM overflowed at every loss scale (4 x 25 x 2^10), so the scaler backed off forever."""
    tokens, width, vocab = 64, 64, 4096
    labels = torch.randint(0, vocab, (1, tokens + 1), generator=torch.Generator().manual_seed(3))
    labels[0, 1:5] = 7
    paths = {
        "full": lambda h, w: ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, vocab, tokens),
        "chunked": lambda h, w: linear_cross_entropy(h, w, labels, tokens, 16),
    }
    found = {}
    for name, loss_of in paths.items():
        torch.manual_seed(0)
        hidden = torch.randn(1, tokens + 1, width)
        hidden[..., 0] = 25.0
        weight = torch.randn(vocab, width) * 0.02
        found[name] = _first_finite_step(loss_of, hidden.requires_grad_(), weight.requires_grad_())
    (full_scale, full_tried), (chunked_scale, chunked_tried) = found["full"], found["chunked"]
    assert full_tried[0] == 2.0**16 and full_scale == 2.0**15, full_tried  # the overflow, then its cure
    assert chunked_scale is not None, f"chunked fp16 never took a step; loss scales tried: {chunked_tried}"
    assert chunked_scale >= full_scale, (chunked_tried, full_tried)


def test_evaluation_and_logits_without_labels_are_unchanged() -> None:
    """Evaluation computes the loss only: one head matmul per chunk, no gradient, no head-shaped buffer."""
    full, chunked = _pair()
    ids, labels = _batch()
    with torch.no_grad():
        with HeadTraffic(VOCAB, TINY.hidden_size) as traffic:
            loss = chunked(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(loss, full(input_ids=ids, labels=labels).loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(chunked(input_ids=ids).logits, full(input_ids=ids).logits)
    head_matmuls = [m for m in traffic.matmuls if VOCAB in m[0]]
    assert head_matmuls == [((CHUNK, VOCAB), torch.float32)] * 6 + [((6, VOCAB), torch.float32)]
    assert traffic.created == []


def test_the_default_chunk_is_sized_by_the_vocabulary() -> None:
    """null train.loss_chunk_tokens: one fp32 [chunk, vocab] block of 64 MiB off CUDA (110 tokens at Qwen3's
    151,936; the hidden size would give 524,288 at 32); on CUDA at least 1,024 tokens for a trainable head and
    256 for a frozen one (compute-bound matmuls)."""
    _, chunked = _pair()
    assert use_chunked_loss(copy.deepcopy(chunked), None) == 64 * 2**20 // (4 * VOCAB) == 52428
    assert chunk_tokens_for(151_936) == 110 and chunk_tokens_for(32_000) == 524
    assert chunk_tokens_for(151_936, "cuda") == 1024 and chunk_tokens_for(8_192, "cuda") == 2048
    assert chunk_tokens_for(151_936, "cuda", trainable_head=False) == 256


@pytest.mark.parametrize(("device", "trainable", "tokens"),
                         [("cuda", True, 1024), ("cuda", False, 256), ("cpu", True, 110), ("cpu", False, 110)])
def test_the_default_chunk_follows_the_device_the_head_is_on_and_whether_it_trains(device: str, trainable: bool,
                                                                                    tokens: int) -> None:
    """``use_chunked_loss`` without a chunk or a device reads the head's own: a Qwen3-sized head (151,936
    entries) on a (fake) CUDA tensor gets 1,024 tokens per chunk when it trains, 256 when frozen (LoRA); on the
    CPU 110 either way (the 64 MiB block). The model is built on ``meta`` and its head made a ``FakeTensor``:
    nothing is allocated."""
    vocab = 151_936
    with torch.device("meta"):
        model = build_model(TINY, vocab, eos_id=0)
    with FakeTensorMode():
        weight = torch.empty(vocab, TINY.hidden_size, device=device)
    assert weight.device.type == device
    model.get_output_embeddings().weight = torch.nn.Parameter(weight, requires_grad=trainable)
    assert use_chunked_loss(model, None) == tokens


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
        accumulate_gradients(wrapped.outer, iter(micro), 2, wrapped.maybe_sync, nullcontext(), TOKEN_MEAN_LOSS)
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


def _compiled_chunked(rank: int, world_size: int, backend: str) -> dict:
    """A 12-block model: full logits eager, chunked eager, and chunked with its blocks compiled by ``backend``;
    each one's loss and gradients, the chunked path's calls, and Dynamo's graph and frame counts."""
    from torch._dynamo.utils import counters

    from ddptrain.parallel.compile import compile_blocks

    torch.compiler.reset()
    counters.clear()
    full, chunked = _pair(replace(TINY, num_layers=12))
    compiled = copy.deepcopy(chunked)
    with module_compile_backend(backend):
        assert compile_blocks(compiled) == 12
    ids, labels = _batch()
    out: dict = {name: _loss_and_grads(model, ids, labels) for name, model in (("full", full), ("eager", chunked))}
    with CountedChunks() as counted:
        out["compiled"] = _loss_and_grads(compiled, ids, labels)
        out["compiled_logits"] = compiled(input_ids=ids, labels=labels, use_cache=False).logits
    out["calls"], out["chunks"] = counted.calls, counted.chunks
    out["graphs"], out["frames"] = counters["stats"]["unique_graphs"], dict(counters["frames"])
    return out


@pytest.mark.slow  # Inductor compiles a block in ~30 s on a loaded 2-core machine
def test_compiled_blocks_with_the_chunked_loss_give_the_eager_and_full_logits_loss_and_gradients() -> None:
    """train.compile compiles the blocks (Inductor, as a run does); the chunked head and loss run after them, and
    their gradient flows back into the compiled blocks' backward."""
    (ran,) = run_distributed(_compiled_chunked, 1, "inductor", timeout=600)
    (full_loss, full_grads), (eager_loss, eager_grads) = ran["full"], ran["eager"]
    loss, grads = ran["compiled"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    assert grads.keys() == full_grads.keys() and len(grads) == 12 * 9 + 2  # every block's weights, embedding, norm
    for name, grad in grads.items():
        assert _rel(grad, eager_grads[name]) < 2e-6, name
        assert _rel(grad, full_grads[name]) < 2e-6, name
    # on: the chunked path ran (twice: the step and the logits probe), 7 chunks of 7 over 48 positions each,
    # and returned no logits; the 12 blocks were one graph, compiled once, with no graph break
    assert (ran["calls"], ran["chunks"], ran["compiled_logits"]) == (2, 14, None)
    assert ran["graphs"] == 1 and ran["frames"] == {"total": 1, "ok": 1}, (ran["graphs"], ran["frames"])


@pytest.mark.slow  # Dynamo's first trace costs seconds
def test_the_chunked_loss_compiles_into_one_graph_without_a_break() -> None:
    """Not needed by train.compile (which compiles the blocks only), but a whole-model compile may trace it: the
    autograd function and its chunk loop compile with fullgraph=True and give the eager loss and gradients."""
    from ddptrain.models.chunked_loss import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(B, SEQ, 32, requires_grad=True)
    weight = torch.randn(VOCAB, 32, requires_grad=True)
    _, labels = _batch()
    want = linear_cross_entropy(hidden, weight, labels, None, CHUNK)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    torch.compiler.reset()
    compiled = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)
    got = compiled(hidden, weight, labels, None, CHUNK)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.compiler.reset()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert _rel(g, w) < 1e-6


LOOP_STEPS, LOOP_CHUNK, LOOP_ACCUM = 4, 8, 2
LOOP_BASE: Overrides = {  # 2 ranks x micro batch 2 x 2 accumulated = 8 rows a step; 4 chunks of 8 per micro batch
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 64},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 128, "seq_len": 16, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": LOOP_STEPS, "log_every": 1, "eval_every": 0, "loss_chunk_tokens": LOOP_CHUNK},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 0},
}


def _on_and_off(name: str, layer: Overrides, fault: str | None = None) -> list[tuple[str, Overrides, str | None]]:
    on = {**layer, "train": {**layer.get("train", {}), "chunked_loss": True}}
    off = {**layer, "train": {**layer.get("train", {}), "chunked_loss": False}}
    return [(f"{name}-on", on, fault), (f"{name}-off", off, fault)]


@pytest.mark.slow  # 8 short runs on 2 ranks: about a minute on a loaded 2-core machine
def test_through_the_loop_chunked_equals_full_logits_under_zero_1_2_3_packing_and_fp16_overflow(
    tmp_path: Path
) -> None:
    """2 gloo ranks, 2 micro batches accumulated, 4 steps, chunked on then off: ZeRO-1 and ZeRO-3 (a sharded head)
    on fixed windows; ZeRO-2 on packed prompt/completion rows (labels -100 on prompts and each example's first
    token, the loss token-weighted across accumulation and ranks); fp16 with the grad scaler, rank 1's gradients
    overflowed at step 3 (a back-off, not a policy event)."""
    tokenizer = tmp_path / "tokenizer"
    train_bpe([f"{p} {c}" for p, c in generated_instructions(200)], 320).save_pretrained(tokenizer)
    packed = {"data": {"source": "instructions", "format": "prompt_completion", "packing": True,
                       "tokenizer": str(tokenizer), "num_samples": 64, "seq_len": 40}}
    cases = {
        "zero1": {"parallel": {"zero_stage": 1}},
        "zero2-packed": {"parallel": {"zero_stage": 2}, **packed},
        "zero3": {"parallel": {"zero_stage": 3}},
        "fp16-overflow": {"train": {"precision": "fp16", "nan_policy": "abort"}},
    }
    variants = [v for name, layer in cases.items()
                for v in _on_and_off(name, layer, "overflow@step:3:1" if "fp16" in name else None)]
    ranks = run_distributed(outcomes_counting_chunks, 2, str(tmp_path), LOOP_BASE, variants, timeout=600)
    runs = {name: ranks[0][i] for i, (name, _, _) in enumerate(variants)}
    for name in cases:
        on, off = runs[f"{name}-on"], runs[f"{name}-off"]
        assert on["error"] is None and off["error"] is None, (on["error"], off["error"])
        # on: every micro batch of every step went through the chunked path, in more than one chunk, on both
        # ranks; off: none did
        for rank in ranks:
            mine = {r["dir"]: r for r in rank}
            assert mine[on["dir"]]["calls"] == LOOP_STEPS * LOOP_ACCUM and mine[off["dir"]]["calls"] == 0, name
            assert mine[on["dir"]]["chunks"] > 2 * mine[on["dir"]]["calls"], name
        got, want = on["metrics"], off["metrics"]
        assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, LOOP_STEPS + 1))
        rtol = 2e-3 if "fp16" in name else 1e-5
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g["loss"], w["loss"], rel_tol=rtol), (name, g["step"], g["loss"], w["loss"])
            assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=rtol) or not (
                math.isfinite(g["grad_norm"]) or math.isfinite(w["grad_norm"])), (name, g["step"])
        if "fp16" in name:
            assert [m["loss_scale"] for m in got] == [m["loss_scale"] for m in want]
            assert [m["scaler_backoffs"] for m in got] == [m["scaler_backoffs"] for m in want] == [0, 0, 1, 1]
            assert [math.isfinite(m["grad_norm"]) for m in got] == [True, True, False, True]
            assert got[-1]["skipped_steps"] == want[-1]["skipped_steps"] == 0
