"""Traced steps shared by the tests of one module: the planner's ``trace_peak`` answered once per distinct step.

The memory planner traces a fake step (``ddptrain/plan/memory/planner.py``: ``trace_peak``) for every micro batch,
checkpointing mode and depth it weighs, 0.2-1 CPU s each, and a ``Tracer`` keeps its traces only for itself. Tests
that build their own configs (the same tiny model at the same micro batches, with another global batch or device
memory) trace the same steps again; here the module's tests share them.

What a trace depends on is its key: the config as the trace sees it, less what no trace reads (the batch sizes,
``plan.*``, ``metrics.*``: the device's throughput ranks the options, and a MIG slice's traces are its card's;
``train.compile``: the plan traces the eager step; ``parallel.*``: a trace is one rank's bare step,
sharded afterwards by ``planner.shard``, so the ZeRO stages share the traces of their working copy) and with what
the traced step sets in place of the configured value (``model.num_layers``, ``model.activation_checkpointing`` and,
where the step gives it, ``train.chunked_loss``: a 4-block config traced at one block is the 2-block config traced
at one block); the vocabulary; the arguments (the target device by what ``trace_peak`` reads of it, its kind and
bf16 support, which give the traced step's device and compute dtype: an H100, an H200 and an RTX 4090 trace alike,
and its name, memory size and throughput change no trace); and the representative chunk selection in force (a test
replaces it to trace every chunk). A trace is returned as traced: the planner only reads it.

``share_traces`` is a module-scoped fixture's body: ``pytest-xdist`` then keeps the module's tests on one worker
(``tests/helpers/xdist_groups.py``), where they share what they traced.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

import ddptrain.plan.memory.planner as memory_planner
import ddptrain.plan.memory.trace as memory_trace
from ddptrain.config.schema import Config


def step_key(cfg: Config, vocab: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    seen = copy.deepcopy(cfg)
    seen.data.global_batch_size = seen.data.micro_batch_size = seen.data.grad_accum = None  # type: ignore[assignment]
    seen.plan, seen.parallel, seen.metrics = type(seen.plan)(), type(seen.parallel)(), type(seen.metrics)()
    seen.train.compile = False
    for traced in (*args, *kwargs.values()):
        if isinstance(traced, memory_planner.TracedStep):  # what trace_peak sets from the step
            seen.model.num_layers, seen.model.activation_checkpointing = traced.num_layers, traced.checkpointing
            if traced.chunked_loss is not None:
                seen.train.chunked_loss = traced.chunked_loss
    args = tuple(as_traced(a, seen) for a in args)
    # ``states``: the fake models a Tracer keeps to trace on, the same step whichever it is (trace_peak's docstring)
    kwargs = {k: as_traced(v, seen) for k, v in kwargs.items() if k != "states"}
    return repr((seen, vocab, args, sorted(kwargs.items()), memory_trace.representative_chunk_starts))


def as_traced(value: Any, seen: Config) -> Any:
    """An argument as the trace sees it: a target device by what a trace reads of it (``trace_peak`` passes its
    kind to the fake step and its kind and bf16 support to ``compute_dtype``; nothing else of it), a step with its
    chunked loss as it runs (None: the configured one); any other as it is."""
    if isinstance(value, memory_planner.Device):
        return ("device", value.bf16, value.device_type)
    if isinstance(value, memory_planner.TracedStep):
        return dataclasses.replace(value, chunked_loss=seen.train.chunked_loss)
    return value


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
