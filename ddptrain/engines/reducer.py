"""The reducer every engine shares: ready counts, in-order launches and the end-of-backward finalisation.

Engines differ only in their ``Policy`` (bucket or not, launch during or after backward, wait at once or at the
end) and their ``Ordering`` (which stream the collective runs on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.comm import Handle, all_reduce_bytes, all_reduce_sum, when_done
from ddptrain.comm.clock import CommClock, Mark
from ddptrain.engines.buckets import Bucket, assign_buckets
from ddptrain.engines.graph import reachable_leaves
from ddptrain.engines.stats import CommStats
from ddptrain.kernels import TorchKernels


@dataclass(frozen=True)
class Policy:
    """When and how gradients travel."""

    bucketed: bool  # flat buffers up to bucket_cap_mb; otherwise one collective per gradient
    overlap: bool  # launch once a bucket and every earlier one are ready; otherwise after backward
    blocking: bool  # wait for each collective as soon as it is launched; otherwise at the end of backward


class Ordering(Protocol):
    """Where a collective runs relative to the computation that produced its tensor."""

    def launch(self, tensor: torch.Tensor, start: Callable[[], Handle]) -> Handle: ...

    def join(self, handle: Handle) -> None: ...


class InlineOrdering:
    """The collective is ordered by the stream it is launched from: the compute stream (always so on CPU)."""

    def launch(self, tensor: torch.Tensor, start: Callable[[], Handle]) -> Handle:
        return start()

    def join(self, handle: Handle) -> None:
        handle.wait()


class Reducer:
    """Averages gradients over ``group`` during backward so that ``.grad`` is final when backward returns.

    Buckets launch strictly in bucket-index order on every rank, whatever order their gradients arrive in, so
    ranks always issue the same collectives in the same order. The finalisation is queued on the autograd engine
    by the first hook of a backward, as torch DDP does.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        policy: Policy,
        ordering: Ordering,
        group: dist.ProcessGroup | None,
        collective: str,
        bucket_cap_mb: float,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
        kernels: TorchKernels,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.policy = policy
        self.ordering = ordering
        self.group = group
        self.collective = collective
        self.find_unused_parameters = find_unused_parameters
        self.kernels = kernels  # who packs buckets and averages into .grad: Triton or torch
        device = self.params[0].device if self.params else torch.device("cpu")
        self.clock = CommClock.for_collectives(device, group)  # what the collectives' times are read on
        self.stats = CommStats(self.clock)
        self._in_flight: list[tuple[Mark, list[Mark]]] = []  # (launch, [completion once seen]) per collective
        cap = int(bucket_cap_mb * 1024 * 1024) if policy.bucketed else None
        self.buckets = [
            Bucket(indices, [self.params[i] for i in indices], policy.bucketed, gradient_as_bucket_view)
            for indices in assign_buckets(self.params, cap)
        ]
        self._slot = {i: (b, slot) for b in self.buckets for slot, i in enumerate(b.indices)}
        self._world = dist.get_world_size(group)
        self._armed = False
        self._started = False
        self._unused: list[int] = []
        self._ready = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next = 0
        for i, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))

    def prepare_for_backward(self, outputs: Any | None) -> None:
        """Arm the hooks for the next backward; with ``outputs``, parameters they cannot reach count as ready."""
        self._armed = True
        self._started = False
        reachable = reachable_leaves(outputs) if outputs is not None else None
        self._unused = [] if reachable is None else [i for i, p in enumerate(self.params) if id(p) not in reachable]

    def _on_grad_ready(self, index: int, _param: torch.Tensor) -> None:
        if not self._armed:
            return
        if not self._started:
            self._start_backward()
        self._used[index] = True
        self._mark_ready(index)

    def _start_backward(self) -> None:
        self._started = True
        self.stats = CommStats(self.clock)
        self._in_flight = []
        self._ready = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._next = 0
        for bucket in self.buckets:
            bucket.reset()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for i in self._unused:
            self._mark_ready(i)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} received a gradient twice in one backward; the engines expect one "
                "per parameter per backward (reentrant checkpointing is not supported)"
            )
        self._ready[index] = True
        bucket, slot = self._slot[index]
        bucket.add(slot, self._used[index])
        if bucket.pending == 0 and self.policy.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            bucket.pack(self.kernels)
            assert bucket.tensor is not None
            bucket.handle = self._launch(bucket.tensor)
            self._next += 1

    def _launch(self, tensor: torch.Tensor) -> Handle | None:
        """Start summing ``tensor``; the handle to wait on, or None when the policy already waited."""
        start = perf_counter()
        launched: list[Mark] = []

        def collective() -> Handle:
            launched.append(self.clock.mark())  # on the stream the collective is issued from, before it
            return all_reduce_sum(tensor, self.collective, self.group)

        handle = self.ordering.launch(tensor, collective)
        self.stats.collective_s += perf_counter() - start
        self.stats.bytes_sent += all_reduce_bytes(tensor.numel() * tensor.element_size(), self._world)
        if not self.policy.blocking:
            completed: list[Mark] = []
            when_done(handle, lambda: completed.append(self.clock.mark()))
            self._in_flight.append((launched[0], completed))
            return handle
        self._join(handle)
        self.stats.spans.append((launched[0], self.clock.mark()))
        return None

    def _join(self, handle: Handle) -> None:
        start = perf_counter()
        self.ordering.join(handle)
        self.stats.collective_s += perf_counter() - start

    def _finalize(self) -> None:
        compute_done = self.clock.mark()  # queued once backward has computed every gradient
        self._armed = False
        missing = [name for name, ready in zip(self.names, self._ready, strict=True) if not ready]
        if missing:
            raise RuntimeError(
                f"no gradient reached {len(missing)} parameter(s) in this backward ({', '.join(missing[:5])}): pass "
                "find_unused_parameters=True if the forward skips them, and make every output take part in the loss"
            )
        self._launch_ready()
        used = self._globally_used()
        for bucket in self.buckets:
            if bucket.handle is not None:
                self._join(bucket.handle)
            bucket.finish(used, 1.0 / self._world, self.kernels)  # the average: SUM, then scaled on the way out
        joined = self.clock.mark()  # after the joins: every gradient averaged
        # A completion callback may still be running on the collective's thread: the join bounds it from above.
        self.stats.spans += [(launch, done[0] if done else joined) for launch, done in self._in_flight]
        self._in_flight = []
        self.stats.exposed = (compute_done, joined)

    def _globally_used(self) -> list[bool] | None:
        """Which parameters some rank used (with ``find_unused_parameters``); the others keep ``.grad`` untouched."""
        if not self.find_unused_parameters:
            return None
        flags = torch.tensor(self._used, dtype=torch.int32, device=self.params[0].device)
        handle = self._launch(flags)
        if handle is not None:
            self._join(handle)
        return [bool(f) for f in flags.tolist()]
