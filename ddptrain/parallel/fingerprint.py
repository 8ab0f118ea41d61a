"""An exact fingerprint of tensors' bits, computed on their device: what the replica drift check compares.

A tensor's bytes are read as 64-bit words w_0 .. w_{m-1} (a last partial word, little-endian) and summed twice,
in integer arithmetic that wraps modulo 2**64:

- ``total`` = sum of w_i
- ``positional`` = sum of w_i * (2i + 1)

Integer addition gives the same result in any order, so the fingerprint is the same on every device, in every
run, whatever order a kernel reduces in: two ranks agree exactly when their sums do. Changing any one element
changes both words: its word changes by d, with 0 < |d| < 2**64 (an element never spans more than its word), and
an odd multiplier is invertible modulo 2**64. Moving values between positions changes ``positional``. Tensors in a
list are combined with odd weights by their place (2p + 1), so a change in any one of them changes the result.

Memory: the words are a view of the tensor's own bytes (no int64 copy), and the positional sum is split into row
and column sums of a [rows, WIDTH] view, since i = r * WIDTH + c gives 2i + 1 = 2 * WIDTH * r + (2c + 1). So a
fingerprint reads each tensor twice and allocates rows + WIDTH words per tensor, and never reads anything back to
the host: shapes and offsets are metadata.
"""

from __future__ import annotations

import torch

WIDTH = 1024  # words per row of the positional sum's [rows, WIDTH] view


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``[total, positional]`` of one tensor's bits, int64, on its device (the definition; about 10 ops)."""
    block, last = _rows(tensor)
    row_sums, col_sums = block.sum(1), block.sum(0)
    if last is not None:
        row_sums, col_sums = torch.cat([row_sums, last.sum().view(1)]), col_sums + last
    device = tensor.device
    rows = torch.arange(row_sums.numel(), device=device)
    odd = torch.arange(1, 2 * WIDTH, 2, device=device)
    positional = (row_sums * rows).sum() * (2 * WIDTH) + (col_sums * odd).sum()
    return torch.stack([col_sums.sum(), positional])


def combine(fingerprints: torch.Tensor) -> torch.Tensor:
    """One ``[total, positional]`` for the ``[n, 2]`` fingerprints of n tensors in a fixed order, each weighted by
    an odd multiplier by its place (2p + 1): a change in any one tensor, or two tensors swapped, changes it."""
    odd = torch.arange(1, 2 * fingerprints.shape[0], 2, device=fingerprints.device)
    return (fingerprints * odd[:, None]).sum(0)


class Combined:
    """``combine`` of the fingerprints of a fixed list of tensor shapes (a model's parameters, check after check),
    in two reductions per tensor and a few ops for them all: the per-tensor weights are laid out once.

    Equal to ``combine(torch.stack([fingerprint(t) for t in tensors]))``; where a check runs every few steps on a
    model of hundreds of tensors, the ops launched (a few per tensor instead of about ten) are what it costs.
    """

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        place = [2 * p + 1 for p in range(len(tensors))]
        odd = torch.arange(1, 2 * WIDTH, 2, device=device)
        weights = torch.tensor(place, dtype=torch.int64, device=device)
        self.col_total = weights[:, None]  # [P, 1]: a column sum counts once, times its tensor's weight
        self.col_positional = weights[:, None] * odd  # [P, WIDTH]
        # each row sum of tensor p, row r: weight * 2 * WIDTH * r (a last partial row is one row more)
        self.row_positional = torch.cat([
            torch.arange(_row_count(t), device=device) * (2 * WIDTH * w) for t, w in zip(tensors, place, strict=True)
        ]) if tensors else torch.zeros(0, dtype=torch.int64, device=device)

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``[total, positional]`` of ``tensors`` (the shapes given at construction, in that order)."""
        row_sums, col_sums = [], []
        for tensor in tensors:
            block, last = _rows(tensor)
            row_sums.append(block.sum(1))
            col_sums.append(block.sum(0))
            if last is not None:
                row_sums.append(last.sum().view(1))
                col_sums[-1] = col_sums[-1] + last
        if not tensors:
            return torch.zeros(2, dtype=torch.int64, device=self.col_total.device)
        cols = torch.stack(col_sums)
        total = (cols * self.col_total).sum()
        positional = (cols * self.col_positional).sum() + (torch.cat(row_sums) * self.row_positional).sum()
        return torch.stack([total, positional])


def _rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensor's words as a ``[rows, WIDTH]`` int64 view, and the words after them as one ``[WIDTH]`` row padded
    with zeros (a last partial word of fewer than 8 bytes included, little-endian), or None when there are none."""
    raw = tensor.detach().reshape(-1).view(torch.uint8)  # a view of a contiguous tensor (parameters, their shards)
    m = raw.numel() // 8
    words = raw[: 8 * m]
    words = (words if words.storage_offset() % 8 == 0 else words.clone()).view(torch.int64)  # a copy if unaligned
    rows = m // WIDTH
    block = words[: rows * WIDTH].view(rows, WIDTH)
    rest, tail = words[rows * WIDTH:], raw[8 * m:]
    if rest.numel() == 0 and tail.numel() == 0:
        return block, None
    last = torch.zeros(WIDTH, dtype=torch.int64, device=tensor.device)
    last[: rest.numel()] = rest
    if tail.numel():
        shifts = torch.arange(0, 8 * tail.numel(), 8, device=tensor.device)
        last[rest.numel()] = (tail.to(torch.int64) << shifts).sum()
    return block, last


def _row_count(tensor: torch.Tensor) -> int:
    """Rows of ``_rows``'s view, a partial last row included."""
    return -(-(tensor.numel() * tensor.element_size()) // (8 * WIDTH))
