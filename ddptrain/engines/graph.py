"""Which parameters an output's autograd graph can reach: DDP's unused-parameter search."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import torch


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts (Hugging Face outputs included) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from find_tensors(getattr(obj, f.name))


def reachable_leaves(outputs: Any) -> set[int]:
    """``id()`` of every leaf tensor whose gradient a backward from ``outputs`` would accumulate."""
    tensors = list(find_tensors(outputs))
    leaves = {id(t) for t in tensors if t.grad_fn is None and t.requires_grad}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves
