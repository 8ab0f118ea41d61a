"""Traced steps shared by the tests of one module: the planner's ``trace_peak`` answered once per distinct step.

The memory planner traces a fake step (``ddptrain/plan/memory/planner.py``: ``trace_peak``) for every micro batch,
checkpointing mode and depth it weighs, seconds of CPU each, and a ``Tracer`` keeps its traces only for itself. Tests
that build their own configs (the same tiny model at the same micro batches, with another global batch or device
memory) trace the same steps again; here the module's tests share them.

What a trace depends on is its key: the config, except what the planner passes to the trace itself or what no
trace reads (the batch sizes, ``plan.*``); the vocabulary; the arguments (the target device by its name, bf16
support and kind: its memory size changes no trace); and the representative chunk selection in force (a test
replaces it to trace every chunk). A trace is returned as traced: the planner only reads it.

``share_traces`` is a module-scoped fixture's body: ``pytest-xdist`` then keeps the module's tests on one worker
(``tests/helpers/xdist_groups.py``), where they share what they traced.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

import ddptrain.plan.memory.planner as memory_planner
import ddptrain.plan.memory.trace as memory_trace
from ddptrain.config.schema import Config


def device_key(value: Any) -> Any:
    """A target device as a trace sees it; any other argument as it is."""
    if isinstance(value, memory_planner.Device):
        return ("device", value.name, value.bf16, value.device_type)
    return value


def step_key(cfg: Config, vocab: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    step = copy.deepcopy(cfg)
    step.data.global_batch_size = step.data.micro_batch_size = step.data.grad_accum = None  # type: ignore[assignment]
    step.plan = type(step.plan)()
    return repr((step, vocab, tuple(map(device_key, args)), sorted((k, device_key(v)) for k, v in kwargs.items()),
                 memory_trace.representative_chunk_starts))


def share_traces() -> Iterator[dict[str, Any]]:
    """Patch the planner's ``trace_peak`` to trace each distinct step once while the caller's scope lasts; yields
    the traces by key."""
    traces: dict[str, Any] = {}
    trace = memory_planner.trace_peak

    def once(cfg: Config, vocab: int, *args: Any, **kwargs: Any) -> Any:
        key = step_key(cfg, vocab, args, kwargs)
        if key not in traces:
            traces[key] = trace(cfg, vocab, *args, **kwargs)
        return traces[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_planner, "trace_peak", once)
        yield traces
