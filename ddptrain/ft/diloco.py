"""DiLoCo and Streaming DiLoCo across torchft replica groups (``ft.sync=diloco|streaming_diloco``).

Each replica group trains on its own for ``ft.sync_every`` (H) inner steps; then the groups all-reduce their
pseudo-gradients (the window's start parameters minus the local ones), average them, and an outer optimizer (SGD with
Nesterov momentum, ``ft.outer_lr``/``ft.outer_momentum``) steps the start parameters with that average: the new
start of every group. Streaming DiLoCo cuts the model into ``ft.fragments`` pieces (by transformer blocks) synced at
staggered steps of the window, each once per window, so one sync moves 1/fragments of the model and can overlap the
next inner step's compute.

The algorithm is torchft's own (``torchft.local_sgd.DiLoCo``); this module chooses the fragments and the outer
optimizers, keeps the window's position and the outer state in a checkpointable ``state_dict``, and counts the bytes
the outer syncs move. The manager must be built with ``use_async_quorum=False`` (DiLoCo requires it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddptrain.config.choices import FtSync
from ddptrain.config.schema import FtConfig
from ddptrain.errors import ConfigError

if TYPE_CHECKING:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

STATE_VERSION = 1


@dataclass(frozen=True)
class SyncRecord:
    """One fragment's outer sync: after which inner step (counted from 1 since build), which fragment, whether the
    groups committed it (``should_commit``), and the pseudo-gradient payload bytes this rank all-reduced."""

    inner_step: int
    fragment: int
    committed: bool
    nbytes: int


class Fragment(nn.Module):
    """A piece of the model synced as one: the model's own ``Parameter`` objects (not copies), registered under
    their dotted names with the dots replaced, so torchft's updates land in the model."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.model_names = [name for name, _ in named]
        for name, param in named:
            self.register_parameter(name.replace(".", "__"), param)


def local_nbytes(param: torch.Tensor) -> int:
    """Bytes of this rank's part of ``param`` (a DTensor's local shard): what an all-reduce of it moves."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def ddp_bytes_per_step(model: nn.Module) -> int:
    """DDP's gradient all-reduce payload per step and rank, counted the same way: every trainable parameter's
    bytes, each step."""
    return sum(local_nbytes(p) for p in model.parameters() if p.requires_grad)


def _blocks(model: nn.Module) -> tuple[str, int] | None:
    """The model's transformer blocks: the longest ``nn.ModuleList`` (Llama's ``model.layers``, GPT-2's
    ``transformer.h``), as (its dotted name, its length); None without one of two or more."""
    best: tuple[str, int] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and (best is None or len(module) > best[1]):
            best = (name, len(module))
    return best


def _block_units(names: list[str], prefix: str) -> list[int]:
    """Each parameter's unit: its block's position among the blocks that hold trainable parameters; what comes
    before the blocks in parameter order (embeddings) joins the first, what comes after (final norm, head) the last,
    anything between two blocks the one before it."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\." if prefix else r"^(\d+)\.")
    block = [int(m.group(1)) if (m := pattern.match(name)) else None for name in names]
    units = {b: i for i, b in enumerate(sorted({b for b in block if b is not None}))}
    out, current = [], 0
    for b in block:
        current = units[b] if b is not None else current
        out.append(current)
    return out


def _balanced_runs(sizes: list[int], n: int) -> list[int]:
    """Each unit's run: ``n`` contiguous non-empty runs of the units in order, the k-th cut where the running total
    of bytes is nearest k/n of the whole (a fragment's sync moves its bytes: even fragments even out the syncs)."""
    total = sum(sizes)
    running = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cuts: list[int] = []  # the index of the last unit of each run but the last
    for k in range(1, n):
        lo, hi = (cuts[-1] + 1 if cuts else 0), len(sizes) - (n - k) - 1  # every later run keeps a unit
        cuts.append(min(range(lo, hi + 1), key=lambda i, k=k: abs(running[i] - k * total / n)))
    return [sum(i > c for c in cuts) for i in range(len(sizes))]


def split_fragments(model: nn.Module, n: int) -> list[Fragment]:
    """The model's trainable parameters in ``n`` contiguous fragments of about equal bytes, cut between transformer
    blocks where the model has at least ``n`` of them (the embeddings with the first block, the final norm and head
    with the last), else between parameters. Every trainable parameter is in exactly one fragment (tied weights
    once: ``named_parameters`` lists a shared tensor once)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if len(named) < n:
        raise ConfigError(f"ft.fragments={n}: the model has only {len(named)} trainable parameters to split")
    blocks = _blocks(model)
    sizes = [local_nbytes(p) for _, p in named]
    unit_of = _block_units([name for name, _ in named], blocks[0]) if blocks is not None else [0] * len(named)
    if max(unit_of) + 1 >= n:
        unit_bytes = [0] * (max(unit_of) + 1)
        for size, unit in zip(sizes, unit_of, strict=True):
            unit_bytes[unit] += size
        run_of_unit = _balanced_runs(unit_bytes, n)
        assignment = [run_of_unit[u] for u in unit_of]
    else:
        assignment = _balanced_runs(sizes, n)
    return [Fragment([item for item, f in zip(named, assignment, strict=True) if f == i]) for i in range(n)]


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (the fragments are the parameters themselves, the wrapper adds none)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class OuterSync:
    """torchft's DiLoCo around the trainer's inner optimizer, with its checkpointable state and its byte counts.

    Use: ``with outer:`` around the training loop; every ``inner_optimizer.step()`` inside it is one inner step, and
    the outer syncs run in that call's post-hook (torchft's) when the window says so.
    """

    def __init__(
        self,
        manager: Manager,
        inner_optimizer: torch.optim.Optimizer,
        fragments: list[Fragment],
        *,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        sync_delay: int = 0,
    ) -> None:
        from torchft.local_sgd import DiLoCo

        self.manager = manager
        self.fragments = fragments
        self.sync_every = sync_every
        self.sync_delay = sync_delay
        # torchft syncs one fragment every sync_every / fragments inner steps, rotating through them
        self.interval = sync_every // len(fragments)
        # one outer optimizer per fragment: its momentum is that fragment's alone (torch's SGD refuses Nesterov
        # without momentum, so outer_momentum=0 is plain SGD)
        self.outer_optimizers: list[torch.optim.Optimizer] = [
            torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
            for f in fragments
        ]
        try:
            self.diloco: DiLoCo = DiLoCo(
                manager, list(fragments), inner_optimizer, self.outer_optimizers, sync_every=sync_every,
                fragment_sync_delay=sync_delay,
            )
        except ValueError as e:  # torchft's own refusals (an async-quorum manager, a schedule it cannot keep)
            raise ConfigError(f"ft.sync: torchft's DiLoCo refused this set-up: {e}") from e
        self.fragment_bytes = [sum(local_nbytes(p) for p in f.parameters()) for f in fragments]
        self.inner_optimizer = inner_optimizer
        self.records: list[SyncRecord] = []
        self.inner_steps = 0
        self._since_sync = 0  # inner steps since the last fragment sync: torchft's own count, mirrored
        self._step_before = 0
        self._pending_fragment: int | None = None
        self._hooks: list[Any] = []

    @classmethod
    def build(
        cls,
        manager: Manager,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        ft: FtConfig,
        *,
        sync_delay: int | None = None,
    ) -> OuterSync:
        """DiLoCo (one fragment) for ``ft.sync=diloco``, Streaming DiLoCo (``ft.fragments``) for
        ``streaming_diloco``. Build it after the model's and the inner optimizer's state are in place (a resumed
        run: after loading them, then ``load_state_dict`` this object's state): the window starts from the model's
        parameters now. ``sync_delay``: inner steps a fragment's all-reduce runs under compute before the outer step
        waits for it (torchft's ``fragment_sync_delay``); default 1 under streaming_diloco where a fragment's
        interval allows it, 0 under diloco."""
        if ft.sync == FtSync.ddp:
            raise ConfigError("ft.sync=ddp: the outer sync is for ft.sync=diloco or streaming_diloco")
        try:
            import torchft.local_sgd  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"ft.sync={ft.sync}: needs torchft: pip install 'ddptrain[ft]'") from e
        n = ft.fragments if ft.sync == FtSync.streaming_diloco else 1
        if ft.sync == FtSync.diloco and ft.fragments != 1:
            raise ConfigError(f"ft.fragments={ft.fragments}: fragments are for ft.sync=streaming_diloco "
                              "(ft.sync=diloco syncs the whole model at once)")
        if ft.sync_every % n:
            raise ConfigError(f"ft.sync_every={ft.sync_every}: expected a multiple of ft.fragments={n} "
                              "(each fragment syncs once per window, at its own step)")
        interval = ft.sync_every // n
        if sync_delay is None:
            sync_delay = 1 if ft.sync == FtSync.streaming_diloco and interval >= 2 else 0
        if not 0 <= sync_delay < interval:
            raise ValueError(f"sync_delay={sync_delay}: expected 0 to {interval - 1} "
                             "(ft.sync_every / ft.fragments - 1)")
        return cls(manager, inner_optimizer, split_fragments(_unwrap(model), n), sync_every=ft.sync_every,
                   outer_lr=ft.outer_lr, outer_momentum=ft.outer_momentum, sync_delay=sync_delay)

    # -- the training loop's side ---------------------------------------------------------------------------------

    def __enter__(self) -> OuterSync:
        # order matters: the post-hook that counts runs after torchft's, which does the sync
        self._hooks.append(self.inner_optimizer.register_step_pre_hook(self._pre_step))
        self.diloco.__enter__()
        self._hooks.append(self.inner_optimizer.register_step_post_hook(self._post_step))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.diloco.__exit__(exc_type, exc, tb)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _pre_step(self, *_: object) -> None:
        self._step_before = self.manager.current_step()

    def _post_step(self, *_: object) -> None:
        self.inner_steps += 1
        self._since_sync += 1
        if self.sync_delay and self._since_sync == self.interval - self.sync_delay:
            # torchft picked the fragment (manager step mod fragments) after this step's quorum, a heal included
            self._pending_fragment = self.manager.current_step() % len(self.fragments)
        if self._since_sync < self.interval:
            return
        fragment = self._pending_fragment if self._pending_fragment is not None else (
            self._step_before % len(self.fragments))
        # the manager's step advances only on a committed sync (a heal at the quorum moves it too: counted as one)
        committed = self.manager.current_step() > self._step_before
        self.records.append(SyncRecord(self.inner_steps, fragment, committed, self.fragment_bytes[fragment]))
        self._since_sync = 0
        self._pending_fragment = None

    def checkpoint_ok(self) -> bool:
        """Whether the state can be saved now: not while a fragment's all-reduce is in flight (the ``sync_delay``
        steps before its outer step), which no checkpoint can hold. Always true with ``sync_delay=0``."""
        return self._since_sync < self.interval - self.sync_delay

    # -- bytes ----------------------------------------------------------------------------------------------------

    def bytes_per_window(self) -> int:
        """Pseudo-gradient payload bytes this rank all-reduces per window of ``sync_every`` inner steps: every
        fragment once, so the whole trainable model once (the ring's wire bytes are 2(R-1)/R of it, as DDP's)."""
        return sum(self.fragment_bytes)

    def bytes_per_step(self) -> float:
        """The mean payload per inner step, outer bytes ÷ H: summary.json's ``comm_bytes`` under DiLoCo, the
        figure to set beside DDP's ``ddp_bytes_per_step`` (the same model's gradients, every step)."""
        return self.bytes_per_window() / self.sync_every

    def counters(self) -> dict[str, float]:
        """What ran so far: inner steps, fragment syncs and commits, payload bytes, and their mean per inner step."""
        sent = sum(r.nbytes for r in self.records)
        return {
            "inner_steps": self.inner_steps,
            "outer_syncs": len(self.records),
            "outer_commits": sum(r.committed for r in self.records),
            "outer_bytes": sent,
            "outer_bytes_per_step": sent / self.inner_steps if self.inner_steps else 0.0,
        }

    # -- checkpoint -----------------------------------------------------------------------------------------------

    def _window_starts(self) -> list[dict[str, torch.Tensor]]:
        # torchft 0.2.0 keeps each fragment's window-start parameters in DiLoCo._fragments[i].original_parameters
        # and the window's position in DiLoCo._local_step, and offers no public accessor for either (its own
        # per-fragment state-dict functions, registered with the manager, serve healing and omit the position)
        return [f.original_parameters for f in self.diloco._fragments]

    def state_dict(self) -> dict[str, Any]:
        """The outer state: each fragment's window-start parameters and outer optimizer (momentum), the position in
        the window, the manager's step (which fragment is next) and the counters. With the model's and the inner
        optimizer's state it resumes the run exactly, mid-window too."""
        if not self.checkpoint_ok():
            raise RuntimeError(f"OuterSync.state_dict: a fragment's all-reduce is in flight (inner step "
                               f"{self._since_sync} of {self.interval}); save at a step where checkpoint_ok()")
        return {
            "version": STATE_VERSION,
            "sync_every": self.sync_every,
            "fragments": [f.model_names for f in self.fragments],
            "sync_delay": self.sync_delay,
            "since_sync": self._since_sync,
            "manager": self.manager.state_dict(),
            "window_start": [{n: t.detach().clone() for n, t in start.items()} for start in self._window_starts()],
            "outer_optimizers": [opt.state_dict() for opt in self.outer_optimizers],
            "inner_steps": self.inner_steps,
            "records": [[r.inner_step, r.fragment, r.committed, r.nbytes] for r in self.records],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s state into this freshly built object (same model, ``ft.sync_every``, fragments
        and delay; otherwise one line naming what differs)."""
        if not state:  # a checkpoint of a run without DiLoCo: no window to continue
            raise ConfigError("checkpoint: it holds no DiLoCo state (trained with ft.sync=ddp or without replica "
                              "groups): resume with the ft.sync it trained with, or start a new run")
        mine = {"sync_every": self.sync_every, "fragments": [f.model_names for f in self.fragments],
                "sync_delay": self.sync_delay}
        for key, value in mine.items():
            if state.get(key) != value:
                shown = len(value) if key == "fragments" else value
                theirs = len(state[key]) if key == "fragments" and key in state else state.get(key)
                raise ConfigError(f"checkpoint: its DiLoCo state has {key}={theirs}, this run {shown}: resume with "
                                  "the same ft.sync, ft.sync_every and ft.fragments (and the same model)")
        with torch.no_grad():
            for start, saved in zip(self._window_starts(), state["window_start"], strict=True):
                for name, tensor in start.items():
                    tensor.copy_(saved[name])
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
            opt.load_state_dict(saved)
        self.manager.load_state_dict(state["manager"])
        self.diloco._local_step = state["since_sync"]
        self._since_sync = state["since_sync"]
        self.inner_steps = state["inner_steps"]
        self.records = [SyncRecord(*r) for r in state["records"]]


def outer_sync_summary(outer: OuterSync) -> dict[str, float]:
    """The run summary's figures: ``comm_bytes`` (the mean payload per step, outer bytes ÷ H) and the counters."""
    return {"comm_bytes": outer.bytes_per_step(), **outer.counters(),
            "outer_interval": float(outer.interval), "fragments": float(len(outer.fragments))}


__all__ = ["Fragment", "OuterSync", "SyncRecord", "ddp_bytes_per_step", "outer_sync_summary",
           "split_fragments"]
