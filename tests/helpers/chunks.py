"""Counting the chunked loss's work (``train.chunked_loss``): proof that a run took the chunked path, and how."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.models.chunked_loss import LinearCrossEntropy
from tests.helpers.runs import Overrides, train_outcomes


class CountedChunks:
    """Counts ``LinearCrossEntropy``'s forward calls and the chunks they ran while the context is open."""

    def __init__(self) -> None:
        self.calls = 0
        self.chunks = 0

    def __enter__(self) -> CountedChunks:
        self.original = LinearCrossEntropy.forward

        def counted(ctx, hidden, weight, targets, chunk, compute_dtype, *starts):  # type: ignore[no-untyped-def]
            self.calls += 1
            self.chunks += -(-hidden.shape[0] // chunk)
            return self.original(ctx, hidden, weight, targets, chunk, compute_dtype, *starts)

        LinearCrossEntropy.forward = staticmethod(counted)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        LinearCrossEntropy.forward = staticmethod(self.original)  # type: ignore[method-assign]


def outcomes_counting_chunks(rank: int, world_size: int, tmp: str, base: Overrides,
                             variants: list[tuple[str, Overrides, str | None]]) -> list[dict[str, Any]]:
    """For ``run_distributed``: ``train_outcomes`` (no traced plan) one variant at a time, each outcome with the
    chunked loss's forward ``calls`` and ``chunks`` on this rank."""
    out = []
    for variant in variants:
        with CountedChunks() as counted:
            (outcome,) = train_outcomes(rank, world_size, tmp, base, [variant], False)
        out.append({**outcome, "calls": counted.calls, "chunks": counted.chunks})
    return out


MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (tuples, lists and dicts of them)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return _tensors(list(tree.values()))
    return []


class HeadTraffic(TorchDispatchMode):
    """What the ops run while the mode is on do with tensors shaped like the LM head's weight (``[vocab, hidden]``
    or its transpose): the bytes they read and write (``bytes``; an in-place op reads and writes its target, a view
    moves nothing, an ``out=`` argument is written, not read), the dtypes of the head-shaped tensors they create
    (``created``), and each matmul's output shape and dtype (``matmuls``)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.shapes = {(vocab, hidden), (hidden, vocab)}
        self.bytes = 0
        self.created: list[torch.dtype] = []
        self.matmuls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def _head(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        read = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
        outputs = _tensors(out)
        self.bytes += sum(t.numel() * t.element_size() for t in read + outputs if self._head(t))
        given = read + _tensors(kwargs.get("out"))
        self.created += [t.dtype for t in outputs if self._head(t) and not any(t is i for i in given)]
        if func.overloadpacket in MATMULS:
            self.matmuls += [(tuple(t.shape), t.dtype) for t in outputs]
        return out


def head_bytes_per_chunk(vocab: int, hidden: int, compute_dtype: torch.dtype, chunk: int = 4,
                         weight_dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[float, float]:
    """The LM head's bytes (``HeadTraffic``) one chunk of a trainable head's forward and backward moves, and what
    one call moves besides its chunks: from two calls of 2 and 6 chunks (the difference over 4 chunks)."""
    moved = []
    for chunks in (2, 6):
        hidden_states = torch.randn(chunks * chunk, hidden, device=device, requires_grad=True)
        weight = (torch.randn(vocab, hidden, device=device) * 0.02).to(weight_dtype).requires_grad_()
        targets = torch.randint(0, vocab, (chunks * chunk,), device=device)
        with HeadTraffic(vocab, hidden) as traffic:
            LinearCrossEntropy.apply(hidden_states, weight, targets, chunk, compute_dtype).backward()
        moved.append(traffic.bytes)
    per_chunk = (moved[1] - moved[0]) / 4
    return per_chunk, moved[0] - 2 * per_chunk
