"""Watching the replica groups of a local run (``app/ft_launch.py`` starts them): each group's command line, when
the run stops as a whole, and what it leaves (``summary.json``).

The run stops as a whole, with one line, when the lighthouse is gone or a group found no quorum of
``ft.min_replicas`` within ``ft.quorum_timeout_s`` and no other group got past that step (a group that times out
while the others go on failed alone, and restarts alone): every agent is asked to stop (SIGTERM: the workers checkpoint
if they can reach a check step), and killed with its workers if it has not after ``STOP_WAIT_S``: with no quorum no
step can end, so waiting for the workers' own stop grace would only delay the line. Checkpoints are committed
atomically: the last committed one of every group is kept whatever the kill interrupts. A group still restarting
or healing when another has trained every step is stopped ``FINISH_GRACE_S`` later: no peer is left to heal from.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from ddptrain.diagnose.written import written_since
from ddptrain.errors import say
from ddptrain.ft.layout import QUORUM_LOST, events_path, group_dir
from ddptrain.ft.lighthouse import Lighthouse

POLL_S = 0.2
STOP_WAIT_S = 10.0  # after SIGTERM, how long the agents have before they are killed with their workers
FINISH_GRACE_S = 20.0  # once a group finished the run, how long the others have to finish too


def group_argv(argv: list[str], run_dir: Path, group: int, lighthouse: str) -> list[str]:
    """The group's command line: the user's overrides with the run dir fixed and the group's place in the run."""
    own = ("hydra.run.dir=", "ft.replica_id=", "ft.lighthouse=")
    kept = [a for a in argv if not a.lstrip("+~").startswith(own)]
    return [*kept, f"hydra.run.dir={run_dir}", f"ft.replica_id={group}", f"ft.lighthouse={lighthouse}"]


def watch(agents: list[subprocess.Popen[bytes]], lighthouse: Lighthouse | None, events: GroupEvents) -> str | None:
    """Wait for every agent; stop them all if the lighthouse exits or a group lost its quorum (in ``events``: this
    launch's, ``GroupEvents.of_this_launch``). Returns why the run was stopped (None: every agent ended on its
    own)."""
    finished_at: float | None = None
    while any(agent.poll() is None for agent in agents):
        why = None
        if finished_at is None and any(agent.poll() == 0 for agent in agents):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > FINISH_GRACE_S:
            # a group still restarting or healing when the others are done can never catch up (no peer is left)
            late = [g for g, agent in enumerate(agents) if agent.poll() is None]
            say(f"ddptrain: replica group{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} had not "
                f"finished {FINISH_GRACE_S:g} s after the run's steps were done by another group: stopped")
            stop_all(agents)
            return None
        if lighthouse is not None and (code := lighthouse.exit_code()) is not None:
            why = (f"the torchft lighthouse exited (code {code}) while replica groups were training; stopping "
                   "every group")
        elif (lost := events.lost()) is not None:
            why = lost
        if why is not None:
            stop_all(agents)
            return why
        time.sleep(POLL_S)
    # Every agent has ended. A group that found no quorum stops on its own (its rank 0 records the loss, says its
    # line and exits): when it and the last other group ended within one poll, the loss is read here, not lost.
    return events.lost()


def finished_first(run_dir: Path, groups: int, since: float) -> bool:
    """Whether a group wrote its summary since ``since`` (this launch's start): it trained every step (the late
    groups were stopped after it)."""
    return any(_summary_since(run_dir, g, since) is not None for g in range(groups))


def _summary_since(run_dir: Path, group: int, since: float) -> Path | None:
    """Group ``group``'s summary.json if it was written at or after ``since``. A run continued in its run dir
    keeps the summaries its groups wrote in an earlier launch: those say nothing about this one."""
    path = group_dir(run_dir, group) / "summary.json"
    return path if written_since(path, since) else None


def quorum_lost(run_dir: Path, groups: int) -> str | None:
    """A group's line when it found no quorum in time (its rank 0 records it before stopping) while no other group
    got past that step either: the run can make no progress. A group that timed out while others went on
    committing steps failed alone (e.g. one of its own ranks hung before the quorum, which then waited for it):
    its agent restarts it and it heals, as after any failure of one group."""
    return GroupEvents(run_dir, groups).lost()


class GroupEvents:
    """The groups' event files as the launcher watches them: each poll parses only the lines written since the last
    (every 0.2 s; parsing the whole files each time cost 10 ms of CPU per poll per 1,000 steps of 3 groups: at
    10,000 steps half a core, past 40,000 more than the poll period). What the verdict needs is kept: the step of
    each group's quorum losses and the last step each group committed."""

    def __init__(self, run_dir: Path, groups: int) -> None:
        self.paths = [events_path(run_dir, g) for g in range(groups)]
        self.offsets = [0] * groups  # bytes of each file already parsed (whole lines)
        self.losses: list[tuple[int, int]] = []  # (group, step) of each quorum_lost event
        self.committed = [0] * groups  # the last step each group committed (0: none yet)

    @classmethod
    def of_this_launch(cls, run_dir: Path, groups: int) -> GroupEvents:
        """The events written from now on, made before the groups start. A launch that continues a run
        (``train.resume=auto``) appends to the files of the launches before it: a quorum loss that stopped one of
        those is not this launch's (read from the start, it stopped the continued run at its first poll, before
        any group could commit a step), nor does a step committed before the groups went back to their last
        checkpoints say that a group can get past it now. ``ft.json`` still reads the whole files: the run's
        history."""
        events = cls(run_dir, groups)
        events.offsets = [path.stat().st_size if path.is_file() else 0 for path in events.paths]
        return events

    def lost(self) -> str | None:
        """``quorum_lost``'s line, from the events written so far."""
        self._read_on()
        for g, step in self.losses:
            if not any(last >= step for other, last in enumerate(self.committed) if other != g):
                return (f"replica group {g} found no quorum of ft.min_replicas groups within ft.quorum_timeout_s "
                        f"before step {step}; stopping every group")
        return None

    def _read_on(self) -> None:
        for g, path in enumerate(self.paths):
            try:
                with path.open("rb") as events:
                    events.seek(self.offsets[g])
                    new = events.read()
            except FileNotFoundError:
                continue
            whole = new[:new.rfind(b"\n") + 1]  # a line still being written is read at a later poll
            self.offsets[g] += len(whole)
            for line in whole.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line cut short by a kill (the restarted worker's next line follows it)
                    continue
                if event.get("event") == QUORUM_LOST:
                    self.losses.append((g, event["step"]))
                elif event.get("event") == "step" and event.get("committed"):
                    self.committed[g] = max(self.committed[g], event["step"])


def stop_all(agents: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every agent (its workers checkpoint at their next check step if they reach one), then a kill."""
    for agent in agents:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for agent in agents:
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill(agent)


def kill(agent: subprocess.Popen[bytes]) -> None:
    """The agent's whole session: the agent and its workers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()


def publish_summary(run_dir: Path, groups: int, record: dict, since: float) -> None:
    """``<run dir>/summary.json``: the lowest group's that finished in this launch (started at ``since``), with
    ``ft.json``'s per-group record and each step's quorum size; nothing when no group finished (a continued run
    that failed leaves the earlier launch's summary as it was, not its figures under this launch's record)."""
    for g in range(groups):
        if (path := _summary_since(run_dir, g, since)) is not None:
            summary = json.loads(path.read_text())
            summary["ft"] = {**summary.get("ft", {}), "summary_of_group": g, **record}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            return
