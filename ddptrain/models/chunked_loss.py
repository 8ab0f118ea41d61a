"""The LM head and the cross-entropy chunk by chunk over the tokens: the ``[tokens, vocab]`` logits never exist
whole (``train.chunked_loss``).

With a large vocabulary the logits, their log-softmax and their gradient are the largest tensors of a language
model's step (Qwen3's 151,936 entries per token: 0.6 MB per token in fp32, each). ``LinearCrossEntropy`` takes
the final hidden states and the head's weight and, for one chunk of tokens at a time, computes the logits, their
log-softmax and the loss, and at once the gradient with respect to the chunk's hidden states and the head weight
(softmax minus the one-hot target, times the weight or the hidden states). Only those gradients are kept (the
size of the hidden states and of the head weight; the head weight's accumulated in fp32, chunk by chunk, with no
half-precision ``[vocab, hidden]`` temporary); backward scales them in place by the incoming gradient. This is the
design of Liger's fused linear cross-entropy: the head's matmuls run once each, as in the full path (a
recomputing backward, TRL's and torchtitan's choice, runs the head's forward matmul twice).

Exactness: the loss is the summed token cross-entropy computed as the full path computes it (the head's matmul
in the autocast dtype, the log-softmax in fp32); the caller divides it by the tokens the full path divides by
(``num_items_in_batch``, else the loss tokens), so the token-weighted loss across accumulation and ranks is
unchanged. Labels of -100 (prompt tokens, each packed example's first token) carry no loss and no gradient.
All rows are computed (masked rows contribute zero) rather than gathered, which would read the mask's count
back to the host on a GPU.

Where it runs: ``use_chunked_loss`` replaces the forward of the causal-LM object (the one holding ``lm_head``)
by one that runs the base model, then this function on ``lm_head.weight`` when labels are given (without
labels, e.g. generation or a logits probe, the model's own forward runs). The weight is read inside that forward,
so under FSDP2 (which shards the head with the root module) it is the gathered parameter, and under torch DDP the
gradient reaches the parameter's own accumulator: the hooks that sync or reduce-scatter it fire as they do for
the full path. A frozen head (LoRA, QLoRA) gets no weight gradient computed; a tied head's gradient lands on
the shared embedding weight, as autograd adds both uses.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ddptrain.data.types import IGNORE

# The size of one fp32 [chunk, vocab] block; a chunk holds about three at once (the matmul's output, its
# log-softmax, which becomes the gradient in place, and a temporary): ~191 MiB measured at 151,936. Off CUDA
# (the CPU) this alone sizes the chunk: a CPU's matmuls are compute-bound at any chunk of tens of tokens.
DEFAULT_CHUNK_BYTES = 64 * 1024**2
# On CUDA the chunk is at least this many tokens, so that the head's matmuls stay compute-bound. Per chunk of c
# tokens each matmul does 2*c*V*H FLOPs and must move the head once: the logits' and the hidden-state
# gradient's matmuls read the half-precision weight (2*V*H bytes, beside their small [c, V] and [c, H] sides), an
# arithmetic intensity of 2*c*H/(2*H + 2*c) FLOP/byte, about c; a trainable head's weight-gradient matmul also
# reads and writes the fp32 accumulator (8*V*H bytes), 2*c*H/(8*H + 2*c), about c/4: the binding one. A GPU's
# ridge point (dense bf16 FLOP/s over memory bytes/s) is ~295 FLOP/byte on an H100 SXM (989 TFLOP/s, 3.35 TB/s),
# ~205 on an H200, ~165 on an RTX 4090, ~150 on an A100. The chunks below bring the binding matmul to ~230
# FLOP/byte at H = 2,560 (compute-bound on all but an H100, ~80 % of its ridge there): 1,024 tokens for a
# trainable head, 256 for a frozen one (LoRA), whose binding matmuls are the two that only read the weight.
# The 64 MiB budget alone gives 110 tokens at Qwen3's 151,936 entries: ~25 FLOP/byte for the weight gradient,
# bound by moving the head (~10 % of an H100's tensor cores). The price is memory: at 151,936 entries an fp32
# [1024, vocab] block is 0.58 GiB, and a chunk holds about three (~1.7 GiB; a frozen head's 256 tokens ~0.4 GiB).
CUDA_CHUNK_TOKENS = {True: 1024, False: 256}  # trainable head -> tokens per chunk at least
# Causal LMs whose forward is exactly: base model -> lm_head(hidden states) -> the causal-LM cross-entropy
# (no logit soft-capping, scaling or auxiliary loss), so the chunked path computes the same loss.
EXACT_HEADS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                         "GPT2LMHeadModel"})
# fp16 gradients of the softmax are tiny (a probability of 1e-5 is a subnormal): they are scaled by this power
# of two before the fp16 matmuls and unscaled after (exact: a power of two). Both matmuls stay finite whatever
# the loss scale: the weight gradient's accumulates in fp32 (an fp16 output would overflow once a few tokens
# share a target and a hidden channel is ~25: 4 x 25 x 2^10 > 65504, at every loss scale), and the hidden
# states' stays below 65504 unless a head weight exceeds 32 (a row of the prescaled gradient sums to <= 2^11).
FP16_PRESCALE = 2.0**10


def chunk_tokens_for(vocab_size: int, device_type: str = "cpu", trainable_head: bool = True,
                     budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk: one fp32 ``[chunk, vocab]`` block within ``budget_bytes`` (at least 1), and on CUDA at
    least ``CUDA_CHUNK_TOKENS`` for a trainable or frozen head (compute-bound matmuls)."""
    by_memory = max(1, budget_bytes // (4 * vocab_size))
    return max(by_memory, CUDA_CHUNK_TOKENS[trainable_head]) if device_type == "cuda" else by_memory


def add_product_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``acc += alpha * a @ b`` into the fp32 ``acc``, with no temporary of ``acc``'s size: on CUDA the
    half-precision matmul writes fp32 itself (``out_dtype``, fp32 accumulation in cuBLAS); elsewhere (no such
    kernel on the CPU) in fp32 from upcast copies of ``a`` and ``b``, whose products of two halves are exact in
    fp32, so both sum the same products."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b, alpha=alpha)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, alpha=alpha, out=acc)
    else:
        acc.addmm_(a.float(), b.float(), alpha=alpha)


def chunk_starts(tokens: int, chunk: int) -> Sequence[int]:
    """Where each chunk of ``tokens`` starts: every chunk (the memory plan's fake step passes its own choice,
    a representative subset, to ``use_chunked_loss``)."""
    return range(0, tokens, chunk)


ChunkStarts = Callable[[int, int], Sequence[int]]  # (tokens, tokens per chunk) -> the chunks' first tokens


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets`` (-100: no loss), chunk by chunk.

    ``hidden``: ``[tokens, hidden]``; ``weight``: ``[vocab, hidden]``; ``compute_dtype``: the matmuls' dtype
    (autocast's, or the weight's). Returns an fp32 scalar. The gradients are computed in forward, chunk by chunk,
    and kept; backward only scales them.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype, starts: ChunkStarts = chunk_starts) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        prescale = FP16_PRESCALE if compute_dtype == torch.float16 else 1.0
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            keep = targets != IGNORE
            safe = torch.where(keep, targets, 0)[:, None]
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            # gradients in fp32 where the matmul is low-precision and prescaled (they are unscaled in fp32)
            grad_h = torch.empty(hidden.shape, dtype=torch.float32 if prescale != 1.0 else hidden.dtype,
                                 device=hidden.device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            for start in starts(hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                h = hidden[start:end].to(compute_dtype)
                logp = torch.log_softmax(torch.mm(h, w.t()).float(), dim=1)  # [chunk, vocab], fp32
                mask = keep[start:end]
                loss -= torch.where(mask, logp.gather(1, safe[start:end]).squeeze(1), 0.0).sum()
                if not (need_h or need_w):
                    continue
                grad = logp.exp_()  # softmax, in place
                grad.scatter_add_(1, safe[start:end], torch.full_like(safe[start:end], -1.0, dtype=grad.dtype))
                if prescale != 1.0:
                    grad.mul_(prescale)
                g = grad.to(compute_dtype)
                del logp, grad
                # Rows without loss get no gradient: their hidden-state rows are zeroed on the [chunk, hidden]
                # side, not the [chunk, vocab] one (a pass over the largest tensor saved).
                keep_rows = mask[:, None].to(h.dtype)
                if grad_h is not None:
                    part = torch.mm(g, w).mul_(keep_rows)
                    grad_h[start:end] = part / prescale if prescale != 1.0 else part
                if grad_w is not None:  # in fp32: no half-precision [vocab, hidden] product to copy and rescale
                    add_product_fp32(grad_w, g.t(), h * keep_rows, 1.0 / prescale)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place: a copy of the [vocab, hidden] fp32 gradient would be live beside every activation. A
        # second backward through the same graph (retain_graph) is refused by autograd: the saved tensors changed.
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0).mul_(grad_loss).to(ctx.dtypes[0]) if ctx.has[0] else None
        grad_w = saved.pop(0).mul_(grad_loss).to(ctx.dtypes[1]) if ctx.has[1] else None
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch: torch.Tensor | int | None, chunk: int,
                         starts: ChunkStarts = chunk_starts) -> torch.Tensor:
    """The causal-LM loss of ``hidden`` ``[batch, seq, hidden]`` through the head ``weight``, as transformers'
    ``ForCausalLMLoss`` computes it from the full logits: position t predicts label t+1; the summed token loss over
    ``num_items_in_batch``, or the mean over the loss tokens without it."""
    compute_dtype = (torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type)
                     else weight.dtype)
    if not torch.is_grad_enabled():  # evaluation: no gradient to compute in forward
        hidden, weight = hidden.detach(), weight.detach()
    targets = labels[:, 1:].reshape(-1)
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    total = LinearCrossEntropy.apply(states, weight, targets, chunk, compute_dtype, starts)
    if num_items_in_batch is None:
        return total / (targets != IGNORE).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside ``model`` (a peft wrapper's base model, or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def chunked_loss_refusal(model: torch.nn.Module) -> str | None:
    """Why the chunked loss would not equal ``model``'s own (None: it is exact for this model)."""
    lm = causal_lm_of(model)
    name = type(lm).__name__
    if name not in EXACT_HEADS:
        return f"{name} is not one of the heads it is exact for ({', '.join(sorted(EXACT_HEADS))})"
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or not head.weight.is_floating_point():
        bias = " with a bias" if getattr(head, "bias", None) is not None else ""
        return f"its head is a {type(head).__name__}{bias}, not a plain bias-free linear layer (adapted or quantized)"
    return None


def use_chunked_loss(model: torch.nn.Module, chunk_tokens: int | None, device_type: str | None = None,
                     starts: ChunkStarts = chunk_starts) -> int | None:
    """Compute ``model``'s training loss chunk by chunk from now on, if that is exact for it (see
    ``chunked_loss_refusal``); returns the tokens per chunk, or None where it stays off.

    ``chunk_tokens``: tokens per chunk (None: ``chunk_tokens_for`` the vocabulary and the head, trainable or
    frozen, on ``device_type``: by default the device the head is on; the memory plan, building on ``meta``,
    names its target's). ``starts``: which chunks run (every one; the memory plan's fake step, whose peak is the
    same with fewer, passes a representative few). The model keeps its parameters, state dict and modules; only
    the causal LM's ``forward`` changes, and only when labels are given.
    """
    if chunked_loss_refusal(model) is not None:
        return None
    lm = causal_lm_of(model)
    head = lm.get_output_embeddings()
    chunk = chunk_tokens or chunk_tokens_for(head.out_features, device_type or head.weight.device.type,
                                             head.weight.requires_grad)
    def forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any) -> Any:
        if labels is None or kwargs.get("logits_to_keep", 0) != 0 or "shift_labels" in kwargs:
            # the class's own forward (not a bound method captured here: a deep copy must call its own model)
            return type(self).forward(self, input_ids=input_ids, labels=labels,
                                      num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs.pop("logits_to_keep", None)
        outputs = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs)
        loss = linear_cross_entropy(outputs.last_hidden_state, self.get_output_embeddings().weight, labels,
                                    num_items_in_batch, chunk, starts)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)

    lm.forward = types.MethodType(forward, lm)
    return chunk
