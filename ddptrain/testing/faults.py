"""Fault injection for the reliability tests, driven by ``DDPTRAIN_FAULT``: step hooks that kill, hang, poison or
delay one rank at one point.

Format ``KIND@POINT:STEP[:RANK]``: KIND is kill (SIGKILL this process), hang (stop making progress), nan
(poison this rank's loss), overflow (scale this rank's loss by 2**100 before backward: its gradients overflow
fp16 while the loss stays finite, as after a loss scale that grew too far) or mismatch (call one extra
all-reduce of 3 floats, which no other rank calls); POINT is ``step`` (after optimizer step STEP) or ``save``
(while the checkpoint of STEP is half written, before its commit); a hang may also be in ``data`` or
``forward`` (inside that phase of step STEP). RANK defaults to 0.
Example: ``DDPTRAIN_FAULT=kill@save:6``.
The fault fires only in the first attempt of a run (``TORCHELASTIC_RESTART_COUNT`` 0), so restarts recover.

With replica groups (``ft.replica_groups``), RANK may be ``G/R``: rank R of replica group G (each group's ranks
count from 0; a plain RANK strikes that rank of every group). It fires only in that group's first attempt (its
own agent's restart count). Example: ``DDPTRAIN_FAULT=kill@step:10:1/0``.

Several faults: specs separated by commas, each on its own rank (``kill@step:10:1/0,delay@data:11:0:1000`` kills
group 1's rank 0 after step 10 and slows rank 0 of every group from step 11 on).

A straggler: ``delay@PHASE:STEP:RANK[:MS]`` sleeps MS milliseconds (default 200) in PHASE (``data`` or
``forward``) of every step from STEP on, on RANK only. Example: ``DDPTRAIN_FAULT=delay@data:1:1``.

A gate: ``wait@data:STEP:RANK`` stops RANK in the data phase of step STEP until a file named STEP appears in the
folder ``DDPTRAIN_FAULT_RELEASE`` names (the test creates it when what it waits for has happened, e.g. a killed
replica group's restarted workers have started), so a race a test stages does not depend on the machine's speed.
Each step's gate opens on its own: a test can hold the start until every group is in, and a later step until a
restart has landed. Example: ``DDPTRAIN_FAULT=wait@data:20:0 DDPTRAIN_FAULT_RELEASE=/tmp/gates``, then
``touch /tmp/gates/20``.

A replica that drifts: ``drift@step:STEP:RANK`` changes one element of one parameter on RANK after the update of
STEP (before that step's check): the first element of the last parameter this rank holds a part of, by a relative
2**-7 (plus 2**-20, so that a zero changes too), as silent corruption would.

A spec that does not parse, or names a kind or point that does not exist, is a one-line error on every rank.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ddptrain.errors import ConfigError
from ddptrain.runtime.hooks import StepHooks

log = logging.getLogger("ddptrain")


# kind -> the points it can strike at
POINTS = {"kill": ("step", "save"), "hang": ("step", "save", "data", "forward"), "mismatch": ("step", "save"),
          "nan": ("step",), "overflow": ("step",), "drift": ("step",), "delay": ("data", "forward"), "wait": ("data",)}
RELEASE = "DDPTRAIN_FAULT_RELEASE"  # the folder where a file named after a wait fault's step lets it go on


def step_hooks(rank: int, group: int | None = None) -> StepHooks:
    """This rank's hooks (``group``: its replica group, None without): the fault ``DDPTRAIN_FAULT`` names in a
    run's first attempt, else none. A spec that does not parse is a ``ConfigError`` on every rank, the targeted
    one or not."""
    spec = os.environ.get("DDPTRAIN_FAULT")
    if not spec:
        return StepHooks()
    parsed = [parse_fault(one) for one in spec.split(",")]  # every spec checked, on every rank
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return StepHooks()
    mine = [fault for fault, target in parsed if strikes(target, rank, group)]
    return mine[0] if len(mine) == 1 else Faults(tuple(mine)) if mine else StepHooks()


def strikes(target: int | tuple[int, int], rank: int, group: int | None) -> bool:
    """Whether a fault aimed at ``target`` (a rank, or (group, rank)) strikes this rank of this group."""
    if isinstance(target, tuple):
        return target == (group, rank)
    return target == rank


def parse_fault(spec: str) -> tuple[Fault, int | tuple[int, int]]:
    """``KIND@POINT:STEP[:RANK[:MS]]`` -> the fault and the rank it strikes (``G/R``: (group, rank))."""
    kind, at, where = spec.partition("@")
    point, _, numbers = where.partition(":")
    expected = f"expected KIND@POINT:STEP[:RANK], KIND one of {', '.join(POINTS)}"
    if kind not in POINTS:
        raise ConfigError(f"DDPTRAIN_FAULT={spec}: unknown fault kind {kind!r}; {expected}")
    if not at or point not in POINTS[kind]:
        raise ConfigError(f"DDPTRAIN_FAULT={spec}: a {kind} fault strikes at {' or '.join(POINTS[kind])}; {expected}")
    fields = numbers.split(":") if numbers else []
    limit = 3 if kind == "delay" else 2  # STEP, RANK and a delay's MS
    group_field, slash, rank_field = fields[1].rpartition("/") if len(fields) > 1 else ("", "", "0")
    try:
        step, rank = int(fields[0]), int(rank_field)
        group = int(group_field) if slash else 0
        delay_ms = float(fields[2]) if len(fields) > 2 else 200.0
    except (IndexError, ValueError):
        step = rank = group = -1
        delay_ms = 0.0
    if len(fields) > limit or step < 0 or rank < 0 or group < 0 or delay_ms < 0:
        raise ConfigError(f"DDPTRAIN_FAULT={spec}: expected a step, a rank (or GROUP/RANK)"
                          f"{' and milliseconds' if limit == 3 else ''} after {kind}@{point} (non-negative numbers); "
                          f"{expected}")
    release = os.environ.get(RELEASE, "")
    if kind == "wait" and not release:
        raise ConfigError(f"DDPTRAIN_FAULT={spec}: a wait fault needs {RELEASE}, the folder where a file named "
                          f"{step} releases it")
    gate = os.path.join(release, str(step)) if kind == "wait" else ""
    return Fault(kind, point, step, delay_ms, gate), ((group, rank) if slash else rank)


@dataclass(frozen=True)
class Fault(StepHooks):
    """One fault on this rank: ``kind`` at ``point`` of ``step`` (a delay: of every step from ``step`` on)."""

    kind: str
    point: str
    step: int
    delay_ms: float = 200.0
    release: str = ""  # a wait's: the file it waits for (``<DDPTRAIN_FAULT_RELEASE>/<step>``)

    def step_started(self, step: int, phase: Callable[[str], AbstractContextManager]) -> None:
        """A hang in ``data`` or ``forward`` of its step; a delay there in every step from its step on; a wait in
        ``data`` of its step until its release file exists."""
        if self.kind == "hang" and self.point in ("data", "forward") and step == self.step:
            with phase(self.point):
                _hang()
        if self.kind == "delay" and step >= self.step:
            with phase(self.point):
                time.sleep(self.delay_ms / 1e3)
        if self.kind == "wait" and step == self.step:
            with phase(self.point):
                log.warning("fault injection: waiting at step %d for %s", step, self.release)
                while not os.path.exists(self.release):
                    time.sleep(0.1)

    def poisons_loss(self, step: int) -> bool:
        return self.kind == "nan" and step == self.step

    def overflows_gradients(self, step: int) -> bool:
        return self.kind == "overflow" and step == self.step

    def update_done(self, step: int, model: torch.nn.Module) -> None:
        if self.kind == "drift" and step == self.step:
            _nudge_one_element(model, step)

    def step_ended(self, step: int) -> None:
        self._strike("step", step)

    def before_commit(self, step: int) -> None:
        self._strike("save", step)  # a crash while the write is in flight must leave the previous checkpoint

    def _strike(self, point: str, step: int) -> None:
        """Kill, hang or call a collective no other rank calls, if this is the fault's point and step."""
        if (point, step) != (self.point, self.step):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            _hang()
        if self.kind == "mismatch":
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(3))


@dataclass(frozen=True)
class Faults(StepHooks):
    """Several faults on this rank: each hook asks every one of them."""

    faults: tuple[Fault, ...]

    def step_started(self, step: int, phase: Callable[[str], AbstractContextManager]) -> None:
        for fault in self.faults:
            fault.step_started(step, phase)

    def poisons_loss(self, step: int) -> bool:
        return any(fault.poisons_loss(step) for fault in self.faults)

    def overflows_gradients(self, step: int) -> bool:
        return any(fault.overflows_gradients(step) for fault in self.faults)

    def update_done(self, step: int, model: torch.nn.Module) -> None:
        for fault in self.faults:
            fault.update_done(step, model)

    def step_ended(self, step: int) -> None:
        for fault in self.faults:
            fault.step_ended(step)

    def before_commit(self, step: int) -> None:
        for fault in self.faults:
            fault.before_commit(step)


def _nudge_one_element(model: torch.nn.Module, step: int) -> None:
    """Change the first element of the last parameter this rank holds a part of (an FSDP2 shard's local part)."""
    from torch.distributed.tensor import DTensor

    held = [(name, p.to_local() if isinstance(p, DTensor) else p) for name, p in model.named_parameters()]
    name, tensor = [(n, t) for n, t in held if t.numel() > 0][-1]
    with torch.no_grad():
        tensor.detach().view(-1)[:1].mul_(1 + 2**-7).add_(2**-20)
    log.warning("fault injection: changed %s (its first element held here) after step %d", name, step)


def _hang() -> None:
    while True:
        time.sleep(1)
