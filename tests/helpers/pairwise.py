"""An all-pairs (pairwise) covering design: rows in which every allowed pair of two factors' levels appears at least
once, far fewer rows than the full product.

Greedy and deterministic (the same rows on every run, so test ids are stable): each row starts from the first pair
not covered yet, then gives each other factor the level that covers the most new pairs, the factor's first level
on a tie (list the cheapest or most common level first). ``allowed`` says whether a partial row (a dict of some
factors' levels) is a combination the product accepts; it must accept every row made of first levels, so a row can
always be completed, and its rules must concern two factors at a time, so a pair it accepts can be completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import combinations
from typing import Any

Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]


def pairs_of(factors: dict[str, Sequence[Any]]) -> Iterator[Pair]:
    """Every pair of levels of two different factors, in the factors' order."""
    for a, b in combinations(factors, 2):
        for va in factors[a]:
            for vb in factors[b]:
                yield (a, va), (b, vb)


def row_pairs(row: Row) -> set[Pair]:
    """The pairs a (possibly partial) row covers."""
    return {((a, row[a]), (b, row[b])) for a, b in combinations(row, 2)}


def all_pairs(factors: dict[str, Sequence[Any]], allowed: Callable[[Row], bool]) -> list[Row]:
    """Rows covering every pair ``allowed`` accepts; each row complete (every factor) and accepted."""
    order = list(factors)
    uncovered = [p for p in pairs_of(factors) if allowed(dict(p))]
    rows: list[Row] = []
    while uncovered:
        (a, va), (b, vb) = uncovered[0]
        row: Row = {a: va, b: vb}
        for factor in order:
            if factor in row:
                continue
            candidates = [v for v in factors[factor] if allowed({**row, factor: v})]
            # most newly covered pairs; ties keep the earliest level (max returns the first maximum)
            row[factor] = max(candidates, key=lambda v: len(row_pairs({**row, factor: v}) & set(uncovered)))
        row = {f: row[f] for f in order}
        covered = row_pairs(row)
        uncovered = [p for p in uncovered if p not in covered]
        rows.append(row)
    return rows


def refused_pairs(factors: dict[str, Sequence[Any]], allowed: Callable[[Row], bool]) -> list[Pair]:
    """The pairs ``allowed`` refuses: no row can hold them."""
    return [p for p in pairs_of(factors) if not allowed(dict(p))]
