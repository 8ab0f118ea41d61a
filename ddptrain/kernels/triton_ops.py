"""Triton kernels for the element-wise passes around gradient collectives, each one launch per tensor list.

A launch takes a table with one row per tensor (addresses, element count, and sizes and strides over at most
``MAX_DIMS`` coalesced dimensions) and a chunk table that maps each program to ``BLOCK`` elements of one tensor,
so a bucket of hundreds of gradients is one launch, not hundreds. Importing this module imports Triton: with
``TRITON_INTERPRET=1`` set before that, the kernels run on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ddptrain.errors import flat
from ddptrain.kernels.fallback import FirstLaunchError
from ddptrain.kernels.reference import TorchKernels

BLOCK = 2048  # elements per program: large enough to stream at full bandwidth, small enough for many programs
# Triton's interpreter runs programs one after another in Python, at a cost per program rather than per element:
# there a launch gets few programs, each as large as its largest tensor needs (up to this many elements).
INTERPRETER_MAX_BLOCK = 1 << 16
MAX_DIMS = 4  # dimensions a strided tensor may keep after coalescing; more falls back to torch
COLS = 3 + 3 * MAX_DIMS  # per row: source, destination, numel, sizes, source strides, destination strides
CHUNK_COLS_STRIDED = 2 + MAX_DIMS  # per chunk of a strided launch: row, first element, that element's index
# The same layouts as constants the kernels can read.
_COLS, _SRC_STRIDES, _DST_STRIDES = tl.constexpr(COLS), tl.constexpr(3 + MAX_DIMS), tl.constexpr(3 + 2 * MAX_DIMS)
_CHUNK_COLS_STRIDED = tl.constexpr(CHUNK_COLS_STRIDED)
# A strided tensor's index math is 32-bit (``_offset``): every size plus two blocks must stay under 2^31.
MAX_STRIDED_SIZE = 2**31 - 2 * INTERPRETER_MAX_BLOCK
# Passed to every launch. Triton 3.9 warns (once per process, so once per rank) when a launch leaves FP fusion
# to its default, which 3.10 flips from on to off. Off: the kernels are memory-bound, so a fused multiply-add
# saves no time, and each product (the squared norm's x * x) is rounded on its own, as the interpreter and torch
# round it, whatever Triton's version.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Element types the kernels handle; the others go through torch.
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
SCALE_NONE, SCALE_HOST, SCALE_DEVICE = 0, 1, 2  # no scaling | a float argument | a one-element device tensor


@triton.jit
def _offset(row, digits, j, STRIDES: tl.constexpr):
    """Memory offsets of the elements ``j`` (0 .. BLOCK, int32) past a chunk's first element, whose index over
    the row's sizes (at column 3) is at ``digits``, under the strides at column ``STRIDES``.

    The index of each element is the first element's plus ``j``, carried from the innermost dimension outwards:
    every value is below a size plus the block, which ``_layout`` keeps under 2^31, so the divisions are 32-bit
    (a 64-bit division per element is a long emulated sequence on a GPU); the offsets are 64-bit products."""
    s1 = tl.load(row + 4).to(tl.int32)
    s2 = tl.load(row + 5).to(tl.int32)
    s3 = tl.load(row + 6).to(tl.int32)
    t = tl.load(digits + 3).to(tl.int32) + j
    i3 = t % s3
    t = tl.load(digits + 2).to(tl.int32) + t // s3
    i2 = t % s2
    t = tl.load(digits + 1).to(tl.int32) + t // s2
    i1 = t % s1
    i0 = tl.load(digits).to(tl.int32) + t // s1
    return (
        i0.to(tl.int64) * tl.load(row + STRIDES)
        + i1.to(tl.int64) * tl.load(row + STRIDES + 1)
        + i2.to(tl.int64) * tl.load(row + STRIDES + 2)
        + i3.to(tl.int64) * tl.load(row + STRIDES + 3)
    )


@triton.jit
def _chunk(table, chunks, STRIDED: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tensor row, its entry in the chunk table, its first element and the tensor's element count.

    A chunk starts at a multiple of ``BLOCK`` within its tensor. A strided launch's chunk entries also hold the
    index of that first element over the tensor's sizes (``_offset`` reads it two columns in). With ``EVEN``
    every element count is a multiple of ``VEC``, which the compiler is told: a tensor's last chunk is masked, and
    that mask is then constant over runs of ``VEC`` elements, so its accesses can be vectors too."""
    entry = chunks + (_CHUNK_COLS_STRIDED if STRIDED else 2) * tl.program_id(0)
    row = table + tl.load(entry) * _COLS
    start = tl.multiple_of(tl.load(entry + 1), BLOCK)
    n = tl.load(row + 2)
    if EVEN:
        n = tl.multiple_of(n, VEC)
    return row, entry, start, n


@triton.jit
def _offsets(row, entry, start, STRIDES: tl.constexpr, STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets of a chunk's elements under the strides at column ``STRIDES``."""
    j = tl.arange(0, BLOCK)
    return _offset(row, entry + 2, j, STRIDES) if STRIDED else start + j.to(tl.int64)


@triton.jit
def _mask(start, n, BLOCK: tl.constexpr):
    """The mask of a chunk that ends its tensor; a whole chunk needs none, so its accesses are vectors whenever
    the addresses allow."""
    return start + tl.arange(0, BLOCK).to(tl.int64) < n


@triton.jit
def _address(row, column, DTYPE: tl.constexpr, VEC: tl.constexpr):
    """The tensor address at ``column`` of ``row``; with ``VEC`` > 1 the table's addresses are 16-byte aligned,
    which the compiler cannot see in a value read from memory, so it is told."""
    ptr = tl.load(row + column).to(tl.pointer_type(DTYPE))
    if VEC > 1:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _copy_chunk(row, entry, start, n, scale, scale_ptr, DTYPE: tl.constexpr, SCALE: tl.constexpr,
                STRIDED: tl.constexpr, VEC: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of ``_copy_kernel``: ``MASKED`` for the chunk that ends a tensor."""
    src = _address(row, 0, DTYPE, VEC)
    dst = _address(row, 1, DTYPE, VEC)
    src_off = _offsets(row, entry, start, _SRC_STRIDES, STRIDED, BLOCK)
    dst_off = _offsets(row, entry, start, _DST_STRIDES, STRIDED, BLOCK) if STRIDED else src_off
    mask = _mask(start, n, BLOCK) if MASKED else None
    x = tl.load(src + src_off, mask=mask, other=0.0 if MASKED else None)
    if SCALE == 1:
        x = (x.to(tl.float32) * scale).to(DTYPE)
    elif SCALE == 2:
        x = (x.to(tl.float32) * tl.load(scale_ptr)).to(DTYPE)
    tl.store(dst + dst_off, x, mask=mask)


@triton.jit
def _copy_kernel(table, chunks, scale, scale_ptr, DTYPE: tl.constexpr, SCALE: tl.constexpr,
                 STRIDED: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr):
    """dst[i] = src[i] (times a scale, computed in fp32) for every tensor pair in the table."""
    row, entry, start, n = _chunk(table, chunks, STRIDED, EVEN, VEC, BLOCK)
    if start + BLOCK <= n:
        _copy_chunk(row, entry, start, n, scale, scale_ptr, DTYPE, SCALE, STRIDED, VEC, False, BLOCK)
    else:
        _copy_chunk(row, entry, start, n, scale, scale_ptr, DTYPE, SCALE, STRIDED, VEC, True, BLOCK)


@triton.jit
def _square_sum_chunk(row, entry, start, n, DTYPE: tl.constexpr, STRIDED: tl.constexpr, VEC: tl.constexpr,
                      MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk's sum of squares: ``MASKED`` for the chunk that ends a tensor."""
    src = _address(row, 0, DTYPE, VEC)
    off = _offsets(row, entry, start, _SRC_STRIDES, STRIDED, BLOCK)
    mask = _mask(start, n, BLOCK) if MASKED else None
    x = tl.load(src + off, mask=mask, other=0.0 if MASKED else None).to(tl.float32)
    return tl.sum(x * x, axis=0)


@triton.jit
def _square_sum_kernel(table, chunks, partials, DTYPE: tl.constexpr, STRIDED: tl.constexpr, VEC: tl.constexpr,
                       EVEN: tl.constexpr, BLOCK: tl.constexpr):
    """partials[chunk] = the fp32 sum of squares of this program's elements."""
    row, entry, start, n = _chunk(table, chunks, STRIDED, EVEN, VEC, BLOCK)
    if start + BLOCK <= n:
        total = _square_sum_chunk(row, entry, start, n, DTYPE, STRIDED, VEC, False, BLOCK)
    else:
        total = _square_sum_chunk(row, entry, start, n, DTYPE, STRIDED, VEC, True, BLOCK)
    tl.store(partials + tl.program_id(0), total)


@triton.jit
def _sum_kernel(partials, n, out, BLOCK: tl.constexpr):
    """out = the sum of ``n`` partials, by one program in a fixed order: the same bits on every run."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(partials + idx, mask=idx < n, other=0.0)
    tl.store(out, tl.sum(acc, axis=0))


@triton.jit
def _to_bf16_block(src, dst, start, n, scale, seed, STOCHASTIC: tl.constexpr, MASKED: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One block of ``_to_bf16_kernel``: ``MASKED`` for the last one."""
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n if MASKED else None
    x = tl.load(src + idx, mask=mask, other=0.0 if MASKED else None) * scale
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:  # noqa: SIM108 - a compile-time branch: each variant compiles only its own side
        bias = tl.randint(seed, idx.to(tl.uint32)) & 0xFFFF
    else:
        bias = 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, (bits >> 16) | 0x40, (bits + bias) >> 16)
    tl.store(dst + idx, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _to_bf16_kernel(src, dst, n, scale, seed, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    """dst = bf16(src * scale): round to nearest even on the fp32 bits (as torch does), or stochastically.

    Adding 0x7FFF plus the lowest kept bit, then dropping 16 bits, is round-to-nearest-even; adding 16 random
    bits instead rounds up with probability equal to the dropped fraction (unbiased). NaN stays a quiet NaN.
    Every block but the last is whole and unmasked, so its accesses are 16-byte vectors whatever ``n`` is; only
    the last block is masked.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: a bucket may pass 2^31 elements
    if start + BLOCK <= n:
        _to_bf16_block(src, dst, start, n, scale, seed, STOCHASTIC, False, BLOCK)
    else:
        _to_bf16_block(src, dst, start, n, scale, seed, STOCHASTIC, True, BLOCK)


@triton.jit
def _from_bf16_block(src, dst, start, n, scale, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """One block of ``_from_bf16_kernel``: ``MASKED`` for the last one."""
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n if MASKED else None
    half = tl.load(src + idx, mask=mask, other=0.0 if MASKED else None)
    bits = half.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    tl.store(dst + idx, bits.to(tl.float32, bitcast=True) * scale, mask=mask)


@triton.jit
def _from_bf16_kernel(src, dst, n, scale, BLOCK: tl.constexpr):
    """dst = fp32(src) * scale; widening bf16 is exact (its bits are the high half of the fp32's). Whole blocks
    are unmasked, as in ``_to_bf16_kernel``."""
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: a bucket may pass 2^31 elements
    if start + BLOCK <= n:
        _from_bf16_block(src, dst, start, n, scale, False, BLOCK)
    else:
        _from_bf16_block(src, dst, start, n, scale, True, BLOCK)


def _layout(shape: Sequence[int], *strides: Sequence[int]) -> list[tuple[int, ...]] | None:
    """(size, stride per tensor) over ``MAX_DIMS`` dimensions, merging those contiguous in every tensor; None
    when more remain, or when a size passes ``MAX_STRIDED_SIZE`` (the strided index math is 32-bit)."""
    merged: list[tuple[int, ...]] = []
    for dim, size in enumerate(shape):
        if size == 1:
            continue
        inner = tuple(s[dim] for s in strides)
        if merged and all(outer == s * size for outer, s in zip(merged[-1][1:], inner, strict=True)):
            merged[-1] = (merged[-1][0] * size, *inner)
        else:
            merged.append((size, *inner))
    if len(merged) > MAX_DIMS or any(size > MAX_STRIDED_SIZE for size, *_ in merged):
        return None
    return [(1, *(0 for _ in strides))] * (MAX_DIMS - len(merged)) + merged


_INTERPRETER_LOCK = threading.Lock()


def _block(numels: Sequence[int]) -> int:
    """Elements per program for tensors of these sizes: ``BLOCK`` compiled, larger under the interpreter."""
    if not triton.knobs.runtime.interpret:
        return BLOCK
    return min(INTERPRETER_MAX_BLOCK, triton.next_power_of_2(max(max(numels), 16)))


@functools.lru_cache(maxsize=256)
def _chunk_table(numels: tuple[int, ...], block: int, device: torch.device,
                 sizes: tuple[tuple[int, ...], ...] | None = None) -> torch.Tensor:
    """(row, first element) of every ``block``-sized chunk, and with ``sizes`` (a strided launch: each row's sizes
    over ``MAX_DIMS`` dimensions) that element's index over them, so that no program divides in 64 bits. It
    depends on sizes only, so it is built once per layout. That once, the copy is from pageable memory: complete
    when it returns (a host sync), so the cached table is safe to read from any stream afterwards."""
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    starts = (torch.arange(len(rows)) - first_chunk[rows]) * block
    columns = [rows, starts]
    if sizes is not None:
        dims = torch.tensor(sizes, dtype=torch.int64)[rows]
        rest, digits = starts, []
        for d in range(MAX_DIMS - 1, 0, -1):
            digits.insert(0, rest % dims[:, d])
            rest = rest // dims[:, d]
        columns += [rest, *digits]
    return torch.stack(columns, dim=1).contiguous().to(device)


class Table(NamedTuple):
    """A launch's per-tensor table on the device, and the kernel variant its rows allow."""

    rows: torch.Tensor
    strided: bool  # the pairs need strided addressing (a launch is all strided or all contiguous)
    vec: int  # elements per 16 bytes when every address is a multiple of 16 bytes (vector accesses), else 1
    even: bool  # every element count is a multiple of ``vec``: the last chunk of each tensor is vectors too
    sizes: tuple[tuple[int, ...], ...] | None  # a strided launch: each row's sizes, for its chunk table


def _table(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> Table:
    """The per-tensor table of (source, destination) pairs, copied to ``device`` without a host sync.

    The caller has checked that every pair has a layout (``_layout`` is not None)."""
    values: list[int] = []
    strided = not _contiguous(pairs[0])
    itemsize = pairs[0][0].element_size()
    aligned = even = True
    sizes = []
    for src, dst in pairs:
        assert _contiguous((src, dst)) != strided, "a launch mixes contiguous and strided pairs"
        aligned &= src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
        even &= src.numel() * itemsize % 16 == 0
        dims = _layout(src.shape, src.stride(), dst.stride()) if strided else (
            [(1, 0, 0)] * (MAX_DIMS - 1) + [(src.numel(), 1, 1)])
        assert dims is not None
        values += [src.data_ptr(), dst.data_ptr(), src.numel()]
        values += [d[0] for d in dims] + [d[1] for d in dims] + [d[2] for d in dims]
        sizes.append(tuple(d[0] for d in dims))
    vec = 16 // itemsize if aligned and not strided else 1
    return Table(to_device(values, device), strided, vec, even and vec > 1, tuple(sizes) if strided else None)


def _contiguous(pair: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return pair[0].is_contiguous() and pair[1].is_contiguous()


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without stalling the host.

    A copy from pageable memory makes the host wait for the stream (``cudaMemcpyAsync`` then
    ``cudaStreamSynchronize``); a copy from pinned memory with ``non_blocking`` does not. The tensors are
    rebuilt per launch (gradients' addresses may change between steps), and torch's caching host allocator keeps
    a pinned block from reuse until the copy that reads it has run, so the host tensor may be dropped at once."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _groups(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, list]:
    """Non-empty pairs the kernels take, by (dtype, strided), and the pairs left to torch (other dtypes, or too
    many non-mergeable dimensions). Contiguous pairs launch apart from strided ones, so that one strided pair
    does not put a whole bucket on the slower strided addressing (nor off vector accesses)."""
    groups: dict[tuple[torch.dtype, bool], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    for src, dst in pairs:
        if src.numel() == 0:
            continue
        ok = src.dtype in TL_DTYPES and dst.dtype == src.dtype and src.device == dst.device
        plain = _contiguous((src, dst))
        if ok and (plain or _layout(src.shape, src.stride(), dst.stride())):
            groups.setdefault((src.dtype, not plain), []).append((src, dst))
        else:
            rest.append((src, dst))
    return groups, rest


class TritonKernels(TorchKernels):
    """The fused kernels; dtypes and layouts they do not handle go through the torch reference it extends."""

    name = "triton"

    def __init__(self) -> None:
        self.launched = False  # whether a launch has succeeded in this process

    @contextmanager
    def _launching(self) -> Iterator[None]:
        """Around every launch. A failure before any launch has succeeded (Triton compiles a C launcher with the
        host's compiler at the first launch) is a ``FirstLaunchError``: nothing ran, so the call can be redone on
        torch. Triton's interpreter swaps parts of ``triton.language`` while it runs a kernel, so two threads (a
        collective's completion callback and the main thread) must not interpret at once; compiled launches need
        no lock."""
        with _INTERPRETER_LOCK if triton.knobs.runtime.interpret else nullcontext():
            try:
                yield
            except Exception as exc:
                if self.launched:
                    raise
                raise FirstLaunchError(f"Triton's first kernel launch failed ({type(exc).__name__}: "
                                       f"{flat(str(exc), 300)})") from exc
        self.launched = True

    def copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        groups, rest = _groups(list(zip(srcs, dsts, strict=True)))
        for (dtype, _), pairs in groups.items():
            self._copy(pairs, dtype, SCALE_NONE if scale == 1.0 else SCALE_HOST, scale, None)
        if rest:
            super().copy_([d for _, d in rest], [s for s, _ in rest], scale)

    def scale_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        groups, rest = _groups([(t, t) for t in tensors])
        for (dtype, _), pairs in groups.items():
            self._copy(pairs, dtype, SCALE_DEVICE, 1.0, coef.to(torch.float32))
        if rest:
            super().scale_([t for t, _ in rest], coef)

    def _copy(self, pairs: list, dtype: torch.dtype, mode: int, scale: float, coef: torch.Tensor | None) -> None:
        device = pairs[0][0].device
        table = _table(pairs, device)
        numels = tuple(s.numel() for s, _ in pairs)
        block = _block(numels)
        chunks = _chunk_table(numels, block, device, table.sizes)
        with self._launching():
            _copy_kernel[(len(chunks),)](table.rows, chunks, scale, table.rows if coef is None else coef,
                                         DTYPE=TL_DTYPES[dtype], SCALE=mode, STRIDED=table.strided, VEC=table.vec,
                                         EVEN=table.even, BLOCK=block, **LAUNCH_OPTIONS)

    def squared_norm(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        groups, rest = _groups([(t, t) for t in tensors])
        if not groups:
            return super().squared_norm([t for t, _ in rest])
        device = next(iter(groups.values()))[0][0].device
        launches = []
        for (dtype, _), pairs in groups.items():
            numels = tuple(s.numel() for s, _ in pairs)
            block = _block(numels)
            table = _table(pairs, device)
            launches.append((dtype, table, block, _chunk_table(numels, block, device, table.sizes)))
        partials = torch.empty(sum(len(c) for *_, c in launches), dtype=torch.float32, device=device)
        start = 0
        total = torch.empty((), dtype=torch.float32, device=device)
        with self._launching():
            for dtype, table, block, chunks in launches:
                _square_sum_kernel[(len(chunks),)](table.rows, chunks, partials[start:], DTYPE=TL_DTYPES[dtype],
                                                   STRIDED=table.strided, VEC=table.vec, EVEN=table.even,
                                                   BLOCK=block, **LAUNCH_OPTIONS)
                start += len(chunks)
            _sum_kernel[(1,)](partials, len(partials), total, BLOCK=1024, **LAUNCH_OPTIONS)
        return total + super().squared_norm([t for t, _ in rest]) if rest else total

    def cast_(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, stochastic: bool = False,
              seed: int = 0) -> None:
        n = src.numel()
        fused = src.is_contiguous() and dst.is_contiguous() and n > 0
        block = _block([n])
        grid = (triton.cdiv(n, block),)
        if fused and src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
            with self._launching():
                _to_bf16_kernel[grid](src, dst, n, scale, seed, STOCHASTIC=stochastic, BLOCK=block, **LAUNCH_OPTIONS)
        elif fused and src.dtype == torch.bfloat16 and dst.dtype == torch.float32 and not stochastic:
            with self._launching():
                _from_bf16_kernel[grid](src, dst, n, scale, BLOCK=block, **LAUNCH_OPTIONS)
        else:
            super().cast_(dst, src, scale, stochastic, seed)
