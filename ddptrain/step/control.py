"""Decisions every rank must take alike: stop on SIGTERM/SIGINT, and what to do with a non-finite step.

A steady step reads nothing back to the host. A rank's non-finite loss poisons its gradients (``guard_loss``),
so the gradient collective that follows carries it to every rank; each step's verdict stays on the device
(``NonFiniteSteps``) and the ranks agree on it, and on stop requests, only at check steps (``agree``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from ddptrain.diagnose.evidence import record_evidence
from ddptrain.errors import RunEnded

log = logging.getLogger(__name__)


class Stopped(RunEnded):
    """A requested stop (SIGTERM/SIGINT) completed: the checkpoint is safe, the process exits 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, 128 + signum)


class NonFiniteError(RunEnded):
    """train.nan_policy=abort met a non-finite loss or gradient (decided alike on every rank)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 3)


class StopRequest:
    """SIGTERM or SIGINT asks for a stop at the next check step, where every rank agrees on it (checkpoint, then
    exit): at most ``check_every`` steps later, and never after ``last_step``.

    Preemption gives a short grace: a rank that cannot reach a check (stuck in a hang) exits on its own after
    ``grace_s`` instead of waiting for the launcher's SIGKILL.
    """

    def __init__(self, grace_s: float, check_every: int = 1, last_step: int | None = None, step: int = 0) -> None:
        """``step``: the step the run continues after (a resumed checkpoint's), until the loop sets the step in
        progress."""
        self.grace_s = grace_s
        self.check_every = max(1, check_every)
        self.last_step = last_step
        self.step = step  # the step in progress (or the last one run): the notice counts from it
        self.signum = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            return
        self.signum = signum
        record_evidence(f"{signal.Signals(signum).name} from the launcher", frame)  # in case the stop never comes
        # Ctrl-C reaches every rank (the terminal signals the whole process group): one notice, rank 0's; the
        # others' would print it again in their own "[rank N] WARNING" format
        announce = not dist.is_initialized() or dist.get_rank() == 0
        log.log(logging.WARNING if announce else logging.INFO, "%s received: %s", signal.Signals(signum).name,
                self.notice())
        watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()

    def notice(self) -> str:
        """When the run will stop, as the console says it: the next check step, and the latest it can be (a check
        every ``check_every`` steps; logging and checkpoint steps check too, so it may come sooner)."""
        latest = (self.step // self.check_every + 1) * self.check_every
        if self.last_step is not None:
            latest = min(latest, max(self.last_step, self.step))
        return (f"stopping at the next check step, step {latest} at the latest (train.check_every="
                f"{self.check_every}), after saving a checkpoint")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def guard_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` itself when finite; else NaN, whose gradients are NaN too.

    A non-finite loss can still have finite gradients (an infinite cross-entropy, a poisoned value); this turns
    it into non-finite gradients, which the gradient all-reduce (or FSDP2's reduce-scatter) then spreads to
    every rank: the flag rides on a collective that happens anyway. ``loss * 1.0`` is exact, so finite steps
    are bit-for-bit unchanged.
    """
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The loss of a step that fault injection poisons: NaN, before backward, as a real non-finite loss is."""
    return guard_loss(loss * math.nan)


OVERFLOW = 2.0**100  # an fp16 gradient overflows (> 65504) by far; an fp32 or bf16 one stays finite


def overflowing(scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The backward scaling of a step that fault injection overflows: the loss stays finite, its fp16 gradients
    do not (as after a loss scale that grew too far)."""
    return lambda loss: scale_loss(loss) * OVERFLOW


class NonFiniteSteps:
    """The non-finite steps since the last check, kept on the device so that a step need not read them back.

    Each step is recorded in its own slot (``(step - 1) % check_every``: a check comes at least every
    ``check_every`` steps), as its step number where it was non-finite, else 0 (int64, as the whole agreement).
    A slot per step, not a count, because the ranks agree with a MAX: per slot that is "some rank saw it", which a
    count cannot say.

    Two verdicts per step. ``gradients``: ``not isfinite(grad_norm)``, the same on every rank already, since the
    synced gradients carry every rank's non-finite loss (``guard_loss``) and FSDP2's norm is reduced over all
    shards. ``events``: what ``train.nan_policy`` acts on. In fp32 and bf16 that is the gradients' verdict. In fp16
    it is this rank's own non-finite loss: non-finite gradients from a finite loss are an overflow, the loss
    scaler's back-off, not a policy event; the MAX at the check makes one rank's loss every rank's event.
    """

    def __init__(self, device: torch.device, check_every: int, fp16: bool) -> None:
        self.check_every = check_every
        self.fp16 = fp16
        self.gradients = torch.zeros(check_every, dtype=torch.int64, device=device)
        self.events = torch.zeros(check_every, dtype=torch.int64, device=device) if fp16 else self.gradients

    def record(self, step: int, nonfinite_gradients: torch.Tensor, loss: torch.Tensor) -> None:
        """Step ``step``'s verdicts: its gradients' (alike on every rank) and, in fp16, this rank's ``loss``."""
        slot = (step - 1) % self.check_every
        self.gradients[slot] = torch.where(nonfinite_gradients, step, 0)
        if self.fp16:
            self.events[slot] = torch.where(torch.isfinite(loss.detach()), 0, step)

    def reset(self) -> None:
        self.gradients.zero_()
        self.events.zero_()


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on at a check step."""

    stop: int  # the signal that asks some rank to stop; 0: none
    events: list[int]  # the steps train.nan_policy acts on since the last check (updates skipped on every rank)
    overflows: int  # fp16: steps whose gradients overflowed from a finite loss (the scaler's back-offs)
    fingerprints: list[int]  # the replicas' fingerprint words, reduced (train/drift.py); empty when none rode along


def agree(signum: int, nonfinite: NonFiniteSteps, fingerprints: torch.Tensor | None = None) -> Agreed:
    """A check step: the signal that asks some rank to stop, the non-finite steps since the last check, and, when
    given, the replicas' fingerprint words (int64, laid out for a MAX by ``train/drift.py``).

    Every rank learns the signal, also those the launcher did not signal, so all exit 128 + that signal.
    One small all-reduce and one host read (a sync point), once per check rather than once per step. Integers
    throughout: step numbers, and fingerprint words that a float could not hold exactly.
    """
    stop = torch.tensor([signum], dtype=torch.int64, device=nonfinite.gradients.device)
    parts = [stop, nonfinite.gradients, *([nonfinite.events] if nonfinite.fp16 else [])]
    flags = torch.cat([*parts, *([fingerprints] if fingerprints is not None else [])])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()  # sync point: the host learns the agreed flags here
    nonfinite.reset()
    n = nonfinite.check_every
    ours = 1 + n * (2 if nonfinite.fp16 else 1)
    gradients = {s for s in values[1:1 + n] if s > 0}
    events = {s for s in values[1 + n:ours] if s > 0} if nonfinite.fp16 else gradients
    return Agreed(values[0], sorted(events), len(gradients - events), values[ours:])
