"""An exact fingerprint of a tensor's bits, computed on its device: what the replica drift check compares.

A tensor's bytes are read as 64-bit words w_0 .. w_{m-1} (a last partial word, little-endian) and summed twice,
in integer arithmetic that wraps modulo 2**64:

- ``total`` = sum of w_i
- ``positional`` = sum of w_i * (2i + 1)

Integer addition gives the same result in any order, so the fingerprint is the same on every device, in every
run, whatever order a kernel reduces in: two ranks agree exactly when their sums do. Changing any one element
changes both words: its word changes by d, with 0 < |d| < 2**64 (an element never spans more than its word), and
an odd multiplier is invertible modulo 2**64. Moving values between positions changes ``positional``.

Memory: the words are a view of the tensor's own bytes (no int64 copy), and the positional sum is split into row
and column sums of a [rows, WIDTH] view, since i = r * WIDTH + c gives 2i + 1 = 2 * WIDTH * r + (2c + 1). So a
fingerprint reads the tensor twice and allocates rows + WIDTH words, and never reads anything back to the host:
shapes and offsets are metadata.
"""

from __future__ import annotations

import torch

WIDTH = 1024  # words per row of the positional sum's [rows, WIDTH] view
_ODD: dict[torch.device, torch.Tensor] = {}  # per device: 1, 3, 5, ... 2 * WIDTH - 1


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``[total, positional]`` of ``tensor``'s bits, int64, on its device."""
    raw = _bytes(tensor)
    m = raw.numel() // 8
    words = _words(raw[: 8 * m])
    rows = m // WIDTH
    block, rest = words[: rows * WIDTH].view(rows, WIDTH), words[rows * WIDTH:]
    odd = _odd(tensor.device)
    row_sums, rest_sum = block.sum(1), rest.sum()
    total = row_sums.sum() + rest_sum
    positional = ((row_sums * torch.arange(rows, device=tensor.device)).sum() * (2 * WIDTH)
                  + (block.sum(0) * odd).sum()
                  + rest_sum * (2 * WIDTH * rows) + (rest * odd[: rest.numel()]).sum())
    if raw.numel() > 8 * m:  # the last bytes, as one more word
        tail = raw[8 * m:].to(torch.int64)
        word = (tail << torch.arange(0, 8 * tail.numel(), 8, device=tensor.device)).sum()
        total, positional = total + word, positional + word * (2 * m + 1)
    return torch.stack([total, positional])


def combine(fingerprints: torch.Tensor) -> torch.Tensor:
    """One ``[total, positional]`` for ``[n, 2]`` fingerprints of n tensors in a fixed order, each weighted by an
    odd multiplier by its place (2p + 1): a change in any one tensor, or two tensors swapped, changes it."""
    odd = torch.arange(1, 2 * len(fingerprints), 2, device=fingerprints.device)
    return (fingerprints * odd[:, None]).sum(0)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)  # a view of a contiguous tensor (parameters and their shards are)
    return flat.view(torch.uint8)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """Whole 8-byte words of ``raw`` as int64: a view where the bytes start 8-aligned, else a copy (rare: a slice
    of a larger storage at an odd offset)."""
    return (raw if raw.storage_offset() % 8 == 0 else raw.clone()).view(torch.int64)


def _odd(device: torch.device) -> torch.Tensor:
    if device not in _ODD:
        _ODD[device] = torch.arange(1, 2 * WIDTH, 2, device=device)
    return _ODD[device]
