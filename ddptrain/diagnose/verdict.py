"""The launcher's one sentence after a failed job: which rank hung or died, where, and what the others waited in.

Read from the ranks' evidence in ``<run dir>/hang/`` (``diagnose.evidence``) and the exit status of each failed
worker. Three shapes:

- a rank died of a signal (SIGKILL: the OOM killer or kill -9; SIGSEGV): named with the signal, its step and
  phase; a rank that aborted (SIGABRT) inside a collective is a mismatch (gloo aborts a rank whose peer sent a
  different size). On NCCL a rank whose dump (``nccl_trace_rank_{r}``) or record shows a collective it had not
  finished was waiting: NCCL's watchdog aborted it (SIGABRT) at ``dist.timeout_s``, or the agent stopped it;
  it is a waiter, like a rank that recorded its own timeout;
- ranks in the same collective number of a group with different kinds or sizes: a mismatch, both sides named;
- otherwise the rank(s) the waiting traces back to: late (hung), named with their step, phase and innermost
  ddptrain frame.

Every training process group is read (``diagnose.trace``): under HSDP FSDP2 runs on the 2-D mesh's shard and
replica groups, not the default group, and a rank waits in collective #s of one group for the ranks of that
group that never enqueued #s. A waiter's collective is its first unfinished one on NCCL (the host enqueues more
after it), its last on gloo. A collective of a group other than the default is named with its group.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ddptrain.diagnose.evidence import HANG_DIR, TIMED_OUT, nccl_dump_prefix, read_nccl_dump
from ddptrain.diagnose.trace import DEFAULT_GROUP, current, entered, group_of, progress, unfinished
from ddptrain.diagnose.whereabouts import read_whereabouts
from ddptrain.diagnose.written import written_since

NCCL_WATCHDOG = "aborted by NCCL's watchdog"  # the reason the verdict gives a waiter that NCCL aborted
PHASES = {"data": "data loading", "forward": "forward", "backward": "backward", "optimizer": "the optimizer step",
          "save": "a checkpoint save", "loss mean": "the loss mean of a logging step",
          "check": "the stop and non-finite check", "evaluation": "evaluation", "export": "the model export",
          "after the update": "the end of the step (after the update)", "step start": "the start of a step",
          "start-up": "start-up"}
_T = TypeVar("_T")
_DDPTRAIN_FRAME = re.compile(r'File "[^"]*/(ddptrain/[^"]+\.py)", line (\d+)')


@dataclass(frozen=True)
class Failure:
    """A worker that exited non-zero, as the elastic agent reports it."""

    rank: int
    exitcode: int
    signal: str | None  # e.g. SIGKILL, when the exit code is negative


def verdict(run_dir: Path, failures: list[Failure], world_size: int, timeout_s: float, host: str,
            since: float = 0.0) -> str | None:
    """One sentence naming the rank(s) at fault, or None when the evidence says nothing about a hang or a death.

    ``since``: when this launch started its workers (``time.time()``). Evidence from before is an earlier
    launch's: a run continued in its run dir (``train.resume=auto``) after a hang keeps that hang's files until
    each rank's start replaces its own, and a rank that failed before that (a process group that never formed)
    replaced nothing. Read as this launch's, they named the old hang as this failure's cause."""
    folder = run_dir / HANG_DIR
    records = {r: rec for r, rec in _records(folder).items() if rec.get("time", 0.0) >= since}
    where = {r: w for r in range(world_size) if (w := _read_since(folder / f"rank{r}.where", since,
                                                                  read_whereabouts)) is not None}
    prefix = nccl_dump_prefix(folder)
    dumps = {r: d for r in range(world_size) if (d := _read_since(Path(f"{prefix}{r}"), since,
                                                                  read_nccl_dump)) is not None}
    for r, rec in records.items():  # a record whose own read of the recorder found nothing takes the dump's
        if not rec.get("collectives") and dumps.get(r):
            rec["collectives"], rec["groups"] = dumps[r]["collectives"], dumps[r]["groups"]
    # On NCCL a waiting rank raises nothing: the watchdog aborts it (SIGABRT) at dist.timeout_s, or the agent
    # stops it first; its dump (or its record) shows the collective it had not finished. It waited, as a rank
    # that recorded its own timeout did.
    for r, dump in dumps.items():
        if r not in records and unfinished(dump["collectives"]):
            step, phase = where.get(r, (0, "start-up"))
            records[r] = {"rank": r, "host": host, "reason": NCCL_WATCHDOG, "step": step, "phase": phase,
                          "where": None, **dump}
    waiters = {r: rec for r, rec in records.items()
               if rec["reason"] in (TIMED_OUT, NCCL_WATCHDOG) or unfinished(rec.get("collectives"))}
    # A rank writes a record (or, on NCCL, a dump) only while alive, on its own timeout or the launcher's stop
    # (NCCL: or another rank's timeout): it was alive when the job began to fail, so a SIGKILL after that is the
    # agent ending a rank that did not stop within launch.stop_grace_s, not a cause.
    dead = [f for f in failures if f.exitcode < 0 and f.signal not in ("SIGTERM", "SIGINT", None)
            and f.rank not in records and f.rank not in dumps]
    traces = {r: rec.get("collectives") or [] for r, rec in records.items()}
    traces.update({r: d["collectives"] for r, d in dumps.items() if r not in records})  # e.g. stuck in native code
    evidence = {r: [ev for ev in (records.get(r), dumps.get(r)) if ev] for r in range(world_size)}
    groups = _Groups(world_size, evidence, traces)
    if dead:
        first = dead[0]
        host_of = records.get(first.rank, {}).get("host", host)
        step, phase = where.get(first.rank, (0, "start-up"))
        frame = _read_since(folder / f"rank{first.rank}.stacks", since, _stack_frame)
        others = _waited(waiters, groups, timeout_s, exclude={first.rank})
        if first.signal == "SIGABRT" and frame is not None and frame[1]:
            return (f"rank {first.rank} (host {host_of}) aborted (SIGABRT) inside a collective at step {step} "
                    f"({frame[0]}): its collective does not match its peers' (another kind or size; gloo aborts "
                    f"the rank that receives the wrong size){others}")
        cause = {"SIGKILL": " (the OOM killer, or kill -9)", "SIGSEGV": " (a crash in native code)"}.get(
            first.signal or "", "")
        at = f" ({frame[0]})" if frame else ""
        return (f"rank {first.rank} (host {host_of}) died of {first.signal}{cause} at step {step} in "
                f"{PHASES.get(phase, phase)}{at}{others}")
    if not waiters:
        return None
    if (mismatch := _mismatch(waiters, traces, records, where, groups)) is not None:
        return mismatch
    late = _late(waiters, traces, groups, world_size)
    if not late:
        return None
    parts = []
    for r in sorted(late):
        rec = records.get(r, {})
        step, phase = (rec["step"], rec["phase"]) if rec else where.get(r, (0, "start-up"))
        at = f" ({rec['where']})" if rec.get("where") else ""
        parts.append(f"rank {r} (host {rec.get('host', host)}) hung at step {step} in {PHASES.get(phase, phase)}{at}")
    # a late rank that timed out itself is named above, not among the ranks that waited
    return "; ".join(parts) + _waited(waiters, groups, timeout_s, exclude=late)


class _Groups:
    """The process groups the ranks' evidence names: each group's global ranks as each rank recorded them (torch
    may give groups of different ranks one name on different ranks), else as any rank recorded them (the default
    group: every rank), else the ranks that recorded a collective of it; and its description."""

    def __init__(self, world_size: int, evidence: dict[int, list[dict[str, Any]]],
                 traces: dict[int, list[dict[str, Any]]]) -> None:
        self.own: dict[tuple[int, str], list[int]] = {}
        self.ranks: dict[str, list[int]] = {DEFAULT_GROUP: list(range(world_size))}
        self.desc: dict[str, str] = {}
        for r, found in evidence.items():
            for ev in found:
                for name, group in (ev.get("groups") or {}).items():
                    self.desc.setdefault(name, group.get("desc") or "")
                    if group.get("ranks"):
                        self.own.setdefault((r, name), list(group["ranks"]))
                        self.ranks.setdefault(name, list(group["ranks"]))
        recorded: dict[str, list[int]] = {}
        for r, collectives in traces.items():
            for c in collectives:
                if r not in recorded.setdefault(group_of(c), []):
                    recorded[group_of(c)].append(r)
        for name, ranks in recorded.items():
            self.ranks.setdefault(name, ranks)

    def members(self, group: str, rank: int) -> list[int]:
        """The ranks of ``group`` as ``rank`` knows it."""
        return sorted(self.own.get((rank, group)) or self.ranks.get(group) or [rank])

    def label(self, group: str, rank: int) -> str:
        """`` of group mesh_shard [ranks 0, 1]``; nothing for the default group."""
        if group == DEFAULT_GROUP:
            return ""
        desc = self.desc.get(group, "")
        name = desc if desc and desc != "undefined" else group
        return f" of group {name} [ranks {', '.join(map(str, self.members(group, rank)))}]"


def _mismatch(waiters: dict[int, dict[str, Any]], traces: dict[int, list[dict[str, Any]]],
              records: dict[int, dict[str, Any]], where: dict[int, tuple[int, str]], groups: _Groups) -> str | None:
    """Ranks that called different collectives (kind or size) as the collective a waiter is in."""
    for r in sorted(waiters):
        stuck = current(traces.get(r))
        if stuck is None or stuck.get("op") is None:
            continue
        group, seq = group_of(stuck), stuck["seq"]
        same = {m: c for m in groups.members(group, r) if (c := entered(traces.get(m), group, seq)) is not None
                and c.get("op") is not None}
        if len({(c["op"], c["bytes"]) for c in same.values()}) < 2:
            continue
        sides = []
        for m, c in sorted(same.items()):
            step, phase = (records[m]["step"], records[m]["phase"]) if m in records else where.get(m, (0, "start-up"))
            at = f"at step {step} in {PHASES.get(phase, phase)}" if c is traces[m][-1] else "(the host ran ahead of it)"
            sides.append(f"rank {m} {c['op']} of {_size(c['bytes'])} {at}")
        return (f"mismatched collectives: as collective #{seq}{groups.label(group, r)} the ranks called different "
                "ones: " + "; ".join(sides))
    return None


def _late(waiters: dict[int, dict[str, Any]], traces: dict[int, list[dict[str, Any]]], groups: _Groups,
          world_size: int) -> set[int]:
    """The ranks the waiting is traced back to. A waiter in collective #s of a group waits for each rank of that
    group that is behind it there: one that never enqueued #s, or whose first unfinished collective (of any
    group) it enqueued before its #s. Following those edges from every waiter, the late ranks are the ones reached
    that wait for no one (a rank stuck outside any collective; a waiter whose peers all went past it; ranks stuck
    together in one collective of their group). Without any collective numbers, the ranks that are not waiting."""
    behind: dict[int, set[int]] = {}
    for r in waiters:
        stuck = current(traces.get(r))
        if stuck is None:
            continue
        group, seq = group_of(stuck), stuck["seq"]
        behind[r] = set()
        for m in groups.members(group, r):
            if m != r and (progress(traces.get(m), group) < seq or _stuck_before(traces.get(m), group, seq)):
                behind[r].add(m)
    if not behind:
        return set(range(world_size)) - set(waiters)
    reached: set[int] = set()
    todo = [m for r in behind for m in behind[r]]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(behind.get(m, ()))
    return {m for m in reached if not behind.get(m)}



def _stuck_before(collectives: list[dict[str, Any]] | None, group: str, seq: int) -> bool:
    """Whether a rank whose host enqueued ``seq`` of ``group`` is stuck in a collective it enqueued before that one
    (NCCL returns at enqueue). Of any group: a stream runs a collective only after what it was made to wait on (under
    HSDP the loss mean's all-reduce waits for the replicas' gradient all-reduce), and two groups' collective numbers
    say nothing about their order. Its ``seq`` gone from the ring: its first unfinished one of ``group``, if earlier."""
    collectives = collectives or []
    first = next((i for i, c in enumerate(collectives) if c.get("completed") is False), None)
    if first is None:
        return False
    mine = next((i for i, c in enumerate(collectives) if group_of(c) == group and c["seq"] == seq), None)
    if mine is not None:
        return first < mine
    there = current([c for c in collectives if group_of(c) == group])
    return there is not None and there.get("completed") is False and there["seq"] < seq


def _read_since(path: Path, since: float, read: Callable[[Path], _T | None]) -> _T | None:
    """``read(path)`` if this launch wrote ``path`` (a rank opens its files as it starts), else None."""
    return read(path) if written_since(path, since) else None


def _records(folder: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in folder.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(record["rank"])] = record
    return out


def _waited(waiters: dict[int, dict[str, Any]], groups: _Groups, timeout_s: float, exclude: set[int]) -> str:
    """``; ranks 0, 2 waited in all_reduce #41 (the loss mean ..., 8 bytes) for 15 s (dist.timeout_s)``, one
    clause per collective waited in (HSDP: a shard group's all-gather, a replica group's all-reduce)."""
    ranks = sorted(r for r in waiters if r not in exclude)
    if not ranks:
        return ""
    clauses: dict[tuple[Any, ...], list[int]] = {}
    for r in ranks:
        c = current(waiters[r].get("collectives"))
        key = (group_of(c), tuple(groups.members(group_of(c), r)), c["seq"], c.get("op")) if c else ()
        clauses.setdefault(key, []).append(r)
    parts = []
    for who_ranks in clauses.values():
        rec = waiters[who_ranks[0]]
        who = f"rank {who_ranks[0]}" if len(who_ranks) == 1 else "ranks " + ", ".join(map(str, who_ranks))
        phase = f"{PHASES.get(rec['phase'], rec['phase'])} of step {rec['step']}"
        c = current(rec.get("collectives"))
        if c is None:
            what = f"a collective ({phase})"
        elif c.get("op") is None:  # known from pg_status only: the host enqueued so much after it that the ring
            what = (f"collective #{c['seq']}{groups.label(group_of(c), who_ranks[0])} (gone from the flight "
                    "recorder's ring, the host ran ahead of it)")
        elif c is not (rec.get("collectives") or [None])[-1]:  # NCCL: the host enqueued more after it
            what = (f"{c['op']} #{c['seq']}{groups.label(group_of(c), who_ranks[0])} ({_size(c['bytes'])}, the host "
                    "ran ahead of it)")
        else:
            what = f"{c['op']} #{c['seq']}{groups.label(group_of(c), who_ranks[0])} ({phase}, {_size(c['bytes'])})"
        parts.append(f"{who} waited in {what}")
    return "; " + "; ".join(parts) + f" for {timeout_s:g} s (dist.timeout_s)"


def _stack_frame(path: Path) -> tuple[str, bool] | None:
    """From a faulthandler dump: the innermost ddptrain frame of the first thread listed (the one that crashed
    or the current one), and whether that thread was inside torch.distributed."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    if "Fatal Python error" not in text:
        return None
    block = text[text.index("Fatal Python error"):].split("\n\n")[0:2]
    thread = "\n".join(block)
    frames = _DDPTRAIN_FRAME.findall(thread)
    if not frames:
        return None
    # faulthandler lists the innermost frame first
    return f"{frames[0][0]}:{frames[0][1]}", "torch/distributed" in thread


def _size(nbytes: int) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.1f} KB"
    return f"{nbytes} bytes"
