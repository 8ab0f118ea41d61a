"""The launcher's one sentence after a failed job: which rank hung or died, where, and what the others waited in.

Read from the ranks' evidence in ``<run dir>/hang/`` (``diagnose.evidence``) and the exit status of each failed
worker. Three shapes:

- a rank died of a signal (SIGKILL: the OOM killer or kill -9; SIGSEGV): named with the signal, its step and
  phase; a rank that aborted (SIGABRT) inside a collective is a mismatch (gloo aborts a rank whose peer sent a
  different size). On NCCL a rank whose dump (``nccl_trace_rank_{r}``) or record shows a collective it had not
  finished was waiting: NCCL's watchdog aborted it (SIGABRT) at ``dist.timeout_s``, or the agent stopped it;
  it is a waiter, like a rank that recorded its own timeout;
- ranks in the same collective number with different kinds or sizes: a mismatch, both sides named;
- otherwise the rank(s) whose last collective number is below the one the others timed out in: late (hung),
  named with their step, phase and innermost ddptrain frame.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain.diagnose.evidence import HANG_DIR, TIMED_OUT, nccl_dump_prefix, read_nccl_dump
from ddptrain.diagnose.whereabouts import read_whereabouts

NCCL_WATCHDOG = "aborted by NCCL's watchdog"  # the reason the verdict gives a waiter that NCCL aborted
PHASES = {"data": "data loading", "forward": "forward", "backward": "backward", "optimizer": "the optimizer step",
          "save": "a checkpoint save", "loss mean": "the loss mean of a logging step",
          "check": "the stop and non-finite check", "evaluation": "evaluation", "export": "the model export",
          "after the update": "the end of the step (after the update)", "step start": "the start of a step",
          "start-up": "start-up"}
_DDPTRAIN_FRAME = re.compile(r'File "[^"]*/(ddptrain/[^"]+\.py)", line (\d+)')


@dataclass(frozen=True)
class Failure:
    """A worker that exited non-zero, as the elastic agent reports it."""

    rank: int
    exitcode: int
    signal: str | None  # e.g. SIGKILL, when the exit code is negative


def verdict(run_dir: Path, failures: list[Failure], world_size: int, timeout_s: float, host: str) -> str | None:
    """One sentence naming the rank(s) at fault, or None when the evidence says nothing about a hang or a death."""
    folder = run_dir / HANG_DIR
    records = _records(folder)
    where = {r: w for r in range(world_size) if (w := read_whereabouts(folder / f"rank{r}.where")) is not None}
    prefix = nccl_dump_prefix(folder)
    dumps = {r: d for r in range(world_size) if (d := read_nccl_dump(Path(f"{prefix}{r}"))) is not None}
    for r, rec in records.items():  # a record whose own read of the recorder found nothing takes the dump's
        if not rec.get("collectives") and dumps.get(r):
            rec["collectives"] = dumps[r]
    # On NCCL a waiting rank raises nothing: the watchdog aborts it (SIGABRT) at dist.timeout_s, or the agent
    # stops it first; its dump (or its record) shows the collective it had not finished. It waited, as a rank
    # that recorded its own timeout did.
    for r, dump in dumps.items():
        if r not in records and _unfinished(dump):
            step, phase = where.get(r, (0, "start-up"))
            records[r] = {"rank": r, "host": host, "reason": NCCL_WATCHDOG, "step": step, "phase": phase,
                          "where": None, "collectives": dump}
    waiters = {r: rec for r, rec in records.items()
               if rec["reason"] in (TIMED_OUT, NCCL_WATCHDOG) or _unfinished(rec.get("collectives"))}
    # A rank writes a record (or, on NCCL, a dump) only while alive, on its own timeout or the launcher's stop
    # (NCCL: or another rank's timeout): it was alive when the job began to fail, so a SIGKILL after that is the
    # agent ending a rank that did not stop within launch.stop_grace_s, not a cause.
    dead = [f for f in failures if f.exitcode < 0 and f.signal not in ("SIGTERM", "SIGINT", None)
            and f.rank not in records and f.rank not in dumps]
    if dead:
        first = dead[0]
        host_of = records.get(first.rank, {}).get("host", host)
        step, phase = where.get(first.rank, (0, "start-up"))
        frame = _stack_frame(folder / f"rank{first.rank}.stacks")
        others = _waited(waiters, timeout_s, exclude=first.rank)
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
    last = {r: _last(rec) for r, rec in records.items()}
    last.update({r: _current(d) for r, d in dumps.items() if r not in records})  # e.g. a rank stuck in native code
    top = max((s for r in waiters if (s := last[r]) is not None), key=lambda c: c["seq"], default=None)
    if top is not None:
        same_seq = {r: c for r, c in last.items() if c is not None and c["seq"] == top["seq"]}
        kinds = {(c["op"], c["bytes"]) for c in same_seq.values()}
        if len(kinds) > 1:
            sides = "; ".join(f"rank {r} {c['op']} of {_size(c['bytes'])} at step {records[r]['step']} in "
                              f"{PHASES.get(records[r]['phase'], records[r]['phase'])}"
                              for r, c in sorted(same_seq.items()))
            return f"mismatched collectives: as collective #{top['seq']} the ranks called different ones: {sides}"
        late = [r for r in range(world_size) if r not in same_seq]
    else:
        late = [r for r in range(world_size) if r not in waiters]
    if not late:
        return None
    parts = []
    for r in late:
        rec = records.get(r, {})
        step, phase = (rec["step"], rec["phase"]) if rec else where.get(r, (0, "start-up"))
        at = f" ({rec['where']})" if rec.get("where") else ""
        parts.append(f"rank {r} (host {rec.get('host', host)}) hung at step {step} in {PHASES.get(phase, phase)}{at}")
    # only the ranks that reached the highest collective waited in it; a late rank that timed out below it is named
    # above, not among them
    return "; ".join(parts) + _waited({r: rec for r, rec in waiters.items() if r not in late}, timeout_s,
                                      exclude=None)


def _records(folder: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in folder.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(record["rank"])] = record
    return out


def _last(record: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank was in, or last finished (``_current``)."""
    return _current(record.get("collectives") or [])


def _current(collectives: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The collective a rank was in: on gloo its last one (a collective blocks its caller); on NCCL, whose
    collectives return at enqueue, its first unfinished one (the host may have enqueued more before it blocked);
    when all finished, its last."""
    return next((c for c in collectives if c.get("completed") is False), collectives[-1] if collectives else None)


def _unfinished(collectives: list[dict[str, Any]] | None) -> bool:
    return any(c.get("completed") is False for c in collectives or [])


def _waited(waiters: dict[int, dict[str, Any]], timeout_s: float, exclude: int | None) -> str:
    """``; rank 0 waited in all_reduce #41 (the loss mean ..., 8 bytes) for 15 s (dist.timeout_s)``."""
    ranks = sorted(r for r in waiters if r != exclude)
    if not ranks:
        return ""
    rec = waiters[ranks[0]]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    phase = PHASES.get(rec["phase"], rec["phase"])
    c = _last(rec)
    what = f"{c['op']} #{c['seq']} ({phase} of step {rec['step']}, {_size(c['bytes'])})" if c else \
        f"a collective ({phase} of step {rec['step']})"
    return f"; {who} waited in {what} for {timeout_s:g} s (dist.timeout_s)"


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
