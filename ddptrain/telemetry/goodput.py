"""Goodput: the share of a run's wall-clock spent in productive training steps, and where the rest went.

The definitions follow Google's ML Goodput Measurement (goodput = productive step time / the job's total time;
badput split into start-up, compilation, checkpointing, disruptions and the progress they wasted), measured here
by the loop itself and kept across restarts in ``<run dir>/goodput.json``:

- an **attempt** is one life of the workers: the first launch, each elastic restart (``TORCHELASTIC_RESTART_COUNT``)
  and each manual ``train.resume=auto`` launch. Rank 0 records its attempt (start, buckets so far, last step,
  productive seconds at each checkpoint) atomically at every logging step, after every save, at least every
  ``RECORD_EVERY_S`` seconds of steps, and at the end; a resumed run reads the earlier attempts back.
- an attempt **starts** when the ddptrain launcher's own code began (the first line of the ``ddptrain`` package,
  ``ddptrain.ENTERED_AT``) for a launch's first attempt (``DDPTRAIN_LAUNCH_START``, set by the launcher); for a
  worker that torchrun's agent spawned on its own (a restarted worker, or workers of a bare ``torchrun``, whose
  agent's start-up is then not seen) at that worker process's start; otherwise (one process with no launcher)
  when ddptrain's code began in it. Not the launcher's *process* start: ``sh -c 'pip install ... && exec
  ddptrain ...'`` keeps the shell's PID and its start, and its earlier work is not ddptrain's start-up. (The
  interpreter's own start before ddptrain's first line, tens of milliseconds, is not counted.)
- its seconds go to one bucket each: ``startup`` (from its start to its first step: interpreter, imports, process
  group, data preparation, model build, checkpoint load), ``compile`` (the first step, compilation included, with
  ``train.compile``), ``checkpoint`` (what the loop blocks in a save: all of a synchronous save, the staging of an
  asynchronous one), ``eval`` (validation), ``productive`` (every other step, from its start to its end, logging
  included), ``recovery`` (a replica group's heal: copying a peer's live state after it restarted, before the
  step it rejoins at), ``other`` (the rest of its span: the end-of-run export and summary, chiefly).
- **redone steps**: the productive seconds of steps an attempt computed after the checkpoint a later attempt
  resumed from (they were computed twice); taken out of productive into ``redone_steps``.
- **restart**: the gap from an attempt's last record to the start of the elastic restart that followed it, within
  one launch: failure detection, the dying attempt's unrecorded steps, re-rendezvous. The gap before a manual
  relaunch is time the job did not run: it is reported (``between_launches_s``) and left out of the wall-clock.

The wall-clock is rank 0's (``time.time()``), summed over the attempts' spans and the restart gaps, so the
buckets and ``goodput_pct`` add up to 100 % of it exactly.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

import ddptrain

log = logging.getLogger(__name__)

RECORD_FILE = "goodput.json"
LAUNCH_START_ENV = "DDPTRAIN_LAUNCH_START"  # the launcher's process start, for its first attempt's workers
RECORD_EVERY_S = 10.0  # a record at least this often while steps run, between logging steps
MEASURED = ("startup", "compile", "checkpoint", "eval", "productive", "recovery")
REPORTED = ("startup", "compile", "checkpoint", "eval", "restart", "recovery", "redone_steps", "other")

_process_start_taken = False  # a second train() in one process (tests) starts when it is called


def attempt_start() -> float:
    """When this attempt began (seconds since the epoch); see the module's docstring."""
    global _process_start_taken
    env = os.environ
    if _process_start_taken:
        return time.time()
    _process_start_taken = True
    if env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and env.get(LAUNCH_START_ENV):
        return float(env[LAUNCH_START_ENV])
    if env.get("TORCHELASTIC_RUN_ID"):  # spawned by torchrun's agent, a fresh process: its start is ours
        return process_start()
    return entry_start()


def launcher_start() -> str:
    """The value the launcher puts in ``LAUNCH_START_ENV``: when ddptrain's code began in its process."""
    return repr(entry_start())


def entry_start() -> float:
    """When ddptrain's first line ran in this process (its package's import), on the wall clock: later than the
    process's start when something else ran in the process first and then exec'd ddptrain."""
    return ddptrain.ENTERED_AT


def process_start() -> float:
    """This process's start on the wall clock, to the kernel's tick: now less the process's age, both read on the
    boot-time clock. (psutil's ``create_time`` adds the age to the boot time ``/proc/stat`` gives in whole
    seconds, so it can be up to a second late: a start-up shorter than it was, a wall-clock shorter than the
    steps it holds.)"""
    stat = Path("/proc/self/stat")
    if not stat.is_file():  # not Linux: psutil's figure, to its precision
        return psutil.Process().create_time()
    started_ticks = int(stat.read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the name
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


@dataclass
class Attempt:
    """One attempt's record, as ``goodput.json`` holds it."""

    started: float
    launch: str  # torchrun's run id: an elastic restart keeps it, a new launch has its own
    restart: int  # TORCHELASTIC_RESTART_COUNT
    world_size: int
    resumed_from: int  # the step it continued after (0: a fresh start)
    last_step: int = 0  # the last step it finished, as far as recorded
    recorded_at: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEASURED, 0.0))
    productive_at: dict[str, float] = field(default_factory=dict)  # saved step -> productive seconds up to it

    @classmethod
    def load(cls, record: dict[str, Any]) -> Attempt:
        return cls(**record)


def continuing(resume: str | None, start: int) -> bool:
    """Whether this run continues earlier attempts (a resume asked for, or an elastic restart); a fresh run in an
    old run dir starts a new account."""
    return resume is not None or start > 0 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


class Goodput:
    """This attempt's time by bucket, recorded by rank 0; ``report()`` accounts for every attempt of the run."""

    def __init__(self, started: float, run_dir: Path, is_main: bool, world_size: int, resumed_from: int,
                 earlier: bool, compiles: bool) -> None:
        """``started``: ``attempt_start()``, taken as the run began; ``earlier``: ``continuing(...)``."""
        self.path, self.is_main, self.compiles = run_dir / RECORD_FILE, is_main, compiles
        self.earlier = read_attempts(self.path) if is_main and earlier else []
        self.attempt = Attempt(started, os.environ.get("TORCHELASTIC_RUN_ID", ""),
                               int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), world_size, resumed_from,
                               last_step=resumed_from)
        self._first_step = True
        self._step_start = 0.0
        self._inside = 0.0  # seconds of this step already given to another bucket (checkpoint, eval)

    def step_started(self) -> None:
        now = time.time()
        if self._first_step:
            self.attempt.seconds["startup"] = now - self.attempt.started
        self._step_start, self._inside = now, 0.0

    @contextmanager
    def blocking(self, bucket: str) -> Iterator[None]:
        """Time spent inside a step that is not training: ``checkpoint`` or ``eval``."""
        start = time.time()
        try:
            yield
        finally:
            spent = time.time() - start
            self.attempt.seconds[bucket] += spent
            self._inside += spent

    def recovered(self, seconds: float, healed_to: int) -> None:
        """This step began with a heal from a peer (replica groups, ``ft/replica.py``) that took ``seconds`` and
        brought this attempt to step ``healed_to``: those seconds are recovery, not start-up or training, and the
        attempt continues after ``healed_to`` (the steps it skipped were the peers', not redone here)."""
        if self._first_step:  # called after step_started: the heal, before it, was counted as start-up
            self.attempt.seconds["startup"] -= seconds
        self.attempt.seconds["recovery"] += seconds
        self.attempt.resumed_from = self.attempt.last_step = healed_to

    def step_ended(self, step: int, saved: bool, record: bool) -> None:
        """After the step's update, save and log; ``record``: write the record now (rank 0; a logging step)."""
        now = time.time()
        seconds = self.attempt.seconds
        bucket = "compile" if self._first_step and self.compiles else "productive"
        seconds[bucket] += now - self._step_start - self._inside
        self._first_step = False
        self.attempt.last_step = step
        if saved:
            self.attempt.productive_at[str(step)] = seconds["productive"]
        if record or saved or now - self.attempt.recorded_at >= RECORD_EVERY_S:
            self.record(now)

    def record(self, now: float) -> None:
        """Rank 0: every attempt so far into ``goodput.json``, replaced atomically (a kill leaves the last one)."""
        self.attempt.recorded_at = now
        if not self.is_main:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"attempts": [asdict(a) for a in (*self.earlier, self.attempt)]}, indent=1))
        os.replace(tmp, self.path)

    def report(self) -> dict[str, Any]:
        """The run's goodput so far, every attempt included (rank 0's record; the end of the run)."""
        self.record(time.time())
        return account([*self.earlier, self.attempt])


def read_attempts(path: Path) -> list[Attempt]:
    """The attempts recorded in ``path`` (none when there is no record; an unreadable one is reported and the
    account starts again: goodput never stops a run)."""
    if not path.is_file():
        return []
    try:
        return [Attempt.load(a) for a in json.loads(path.read_text())["attempts"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable (%s); goodput counts from this attempt only", path, exc)
        return []


def account(attempts: list[Attempt]) -> dict[str, Any]:
    """Every attempt's seconds in the reported buckets, the restart gaps and the redone steps; percentages of the
    wall-clock, which they add up to."""
    seconds = dict.fromkeys(("productive", *REPORTED), 0.0)
    between, redone_steps, restarts = 0.0, 0, 0
    for i, a in enumerate(attempts):
        for bucket in MEASURED:
            seconds[bucket] += a.seconds.get(bucket, 0.0)  # an earlier version's record has no "recovery"
        seconds["other"] += (a.recorded_at - a.started) - sum(a.seconds.values())
        if i:
            gap = max(0.0, a.started - attempts[i - 1].recorded_at)
            if a.restart > 0 and a.launch == attempts[i - 1].launch:
                seconds["restart"] += gap
                restarts += 1
            else:
                between += gap
        # an attempt's steps count up to the lowest step any later attempt resumed from; the rest were redone
        kept_upto = min((b.resumed_from for b in attempts[i + 1:]), default=a.last_step)
        if a.last_step > kept_upto:
            lost = redone_seconds(a, max(kept_upto, a.resumed_from))
            seconds["productive"] -= lost
            seconds["redone_steps"] += lost
            redone_steps += a.last_step - max(kept_upto, a.resumed_from)
    wall = sum(seconds.values())
    pct = {f"{k}_pct": 100.0 * v / wall if wall > 0 else 0.0 for k, v in seconds.items() if k != "productive"}
    return {
        "goodput_pct": 100.0 * seconds["productive"] / wall if wall > 0 else 0.0,
        "goodput": {
            "wall_clock_s": wall, **{f"{k}_s": v for k, v in seconds.items()}, **pct,
            "attempts": len(attempts), "restarts": restarts, "relaunches": len(attempts) - 1 - restarts,
            "redone_steps": redone_steps, "between_launches_s": between,
            "world_sizes": [a.world_size for a in attempts],
        },
    }


def redone_seconds(a: Attempt, kept_upto: int) -> float:
    """The productive seconds attempt ``a`` spent after step ``kept_upto``: from its record at that checkpoint,
    else (a checkpoint it saved but did not record) in proportion to the steps."""
    productive = a.seconds["productive"]
    if kept_upto <= a.resumed_from:
        return productive
    if str(kept_upto) in a.productive_at:
        return productive - a.productive_at[str(kept_upto)]
    done = a.last_step - a.resumed_from
    return productive * (a.last_step - kept_upto) / done if done else 0.0


def goodput_line(report: dict[str, Any]) -> str:
    """The final log line: goodput, then where the rest of the wall-clock went."""
    g = report["goodput"]
    names = {"startup": "start-up", "compile": "compile", "checkpoint": "checkpoints", "eval": "eval",
             "restart": "restarts", "recovery": "recovery", "redone_steps": "redone steps", "other": "other"}
    rest = ", ".join(f"{names[k]} {g[f'{k}_pct']:.1f}%" for k in REPORTED)
    redone = f"{g['redone_steps']} step{'' if g['redone_steps'] == 1 else 's'} redone"
    attempts = f" over {g['attempts']} attempts ({redone})" if g["attempts"] > 1 else ""
    return f"goodput {report['goodput_pct']:.1f}% of {g['wall_clock_s']:.1f} s wall-clock{attempts}: {rest}"
