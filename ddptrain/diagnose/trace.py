"""torch's flight-recorder dump, read for the hang verdict: every training process group's collectives in the order
this rank's host enqueued them, each group's global ranks, and (on NCCL) which collectives finished.

The dump (torch 2.13: ``_dump_nccl_trace``, ``_dump_fr_trace`` and NCCL's dump file, the same pickle) is a dict:
``entries`` (one per collective, oldest first: ``process_group`` (name, description), ``pg_id``,
``collective_seq_id`` counted per group, ``profiling_name`` ``nccl:<op>`` or ``gloo:<op>``, ``input_sizes``,
``input_dtypes``, ``state``), ``pg_config`` (per group name: ``ranks``, the group's global ranks as a string;
filled on NCCL, empty on gloo) and ``pg_status`` (per ``pg_id``: the last enqueued, started and completed sequence
number). torch starts a group's status at -1, "none" (``c10d/logger.hpp``), and adds it to the dump with the
group's first entry; collectives are numbered from 1, so a group whose first collective hangs shows -1 completed.

Why the whole dump: NCCL returns at enqueue, so a waiting rank's host goes on enqueuing after the collective it
waits in (the rest of its backward's buckets, FSDP2's all-gathers, the next steps' collectives until a host
read): its stuck collective can be hundreds of entries before its last. It is the group's last completed
collective + 1 (``pg_status``), or the first entry not completed; when the ring (``TORCH_FR_BUFFER_SIZE``) has
dropped it, the reader still knows its group and number from ``pg_status``.
"""

from __future__ import annotations

import ast
from typing import Any

DEFAULT_GROUP = "0"  # torch names the default process group "0"
# The description (``group_desc``) of ddptrain's own groups that are not the training's: the async checkpoint's
# gloo group, whose collectives run on a background thread. They are left out of the verdict's reading.
CHECKPOINT_GROUP = "ddptrain_checkpoint"
SIDE_GROUPS = (CHECKPOINT_GROUP,)
_OP_NAMES = {"all_reduce_barrier": "barrier",  # NCCL records a barrier as a 1-element all-reduce
             "_allgather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor"}
_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
          "Byte": 1, "Bool": 1}

# A read dump, as JSON-ready values (a rank's record holds one):
# {"collectives": [{"group", "seq", "op", "sizes", "bytes"[, "completed"]}, ...] in enqueue order,
#  "groups": {name: {"desc": str, "ranks": [global ranks] | None}}}
Trace = dict[str, Any]


def read_trace(trace: dict[str, Any], nccl: bool) -> Trace:
    """The training groups' collectives of a flight-recorder dump (every group but ``SIDE_GROUPS``; no p2p).

    ``nccl``: the entries' states and ``pg_status`` say which collectives completed; on gloo they do not (an
    entry's state stays ``scheduled``, and a collective that failed counts as completed), so gloo's collectives
    carry no ``completed`` and the one a rank is in is its last.
    """
    entries = [e for e in trace.get("entries") or [] if not e.get("is_p2p")
               and _group(e) is not None and _desc(e) not in SIDE_GROUPS]
    groups: dict[str, dict[str, Any]] = {}
    for name, config in (trace.get("pg_config") or {}).items():
        if name and config.get("desc") not in SIDE_GROUPS:
            groups[str(name)] = {"desc": str(config.get("desc") or ""), "ranks": _ranks(config.get("ranks"))}
    for e in entries:
        groups.setdefault(_group(e), {"desc": _desc(e), "ranks": None})
    out = [_collective(e) for e in entries]
    if nccl:
        status = _status(trace, entries)
        done = _completed_by_group(status, entries)
        for c in out:
            c["completed"] = c["seq"] <= done.get(c["group"], 0)
        out = _dropped_first_unfinished(out, done, status) + out
    return {"collectives": out, "groups": groups}


def current(collectives: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The collective a rank was in: on NCCL its first unfinished one, whatever the host enqueued after it; on
    gloo (or when all finished) its last (a gloo collective blocks its caller)."""
    collectives = collectives or []
    return next((c for c in collectives if c.get("completed") is False), collectives[-1] if collectives else None)


def unfinished(collectives: list[dict[str, Any]] | None) -> bool:
    return any(c.get("completed") is False for c in collectives or [])


def entered(collectives: list[dict[str, Any]] | None, group: str, seq: int) -> dict[str, Any] | None:
    """This rank's collective ``seq`` of ``group``, when it enqueued that far (else None)."""
    return next((c for c in collectives or [] if group_of(c) == group and c["seq"] == seq), None)


def progress(collectives: list[dict[str, Any]] | None, group: str) -> int:
    """The highest collective number this rank enqueued on ``group`` (0: none seen)."""
    return max((c["seq"] for c in collectives or [] if group_of(c) == group), default=0)


def group_of(collective: dict[str, Any]) -> str:
    return str(collective.get("group", DEFAULT_GROUP))  # records of earlier versions held the default group's only


def _collective(e: dict[str, Any]) -> dict[str, Any]:
    sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
    nbytes = sum(_numel(s) * _BYTES.get(d, 4) for s, d in zip(sizes, dtypes, strict=False))
    op = str(e.get("profiling_name", "")).split(":")[-1]
    return {"group": _group(e), "seq": int(e.get("collective_seq_id") or 0), "op": _OP_NAMES.get(op, op),
            "sizes": sizes, "bytes": nbytes}


def _status(trace: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Per group name, ``pg_status``'s (last enqueued, last completed) collective; ``pg_status`` is keyed by
    ``pg_id``, which the entries map to names (a group with no entry left in the ring is not needed)."""
    name_of = {str(e.get("pg_id")): _group(e) for e in entries}
    out: dict[str, tuple[int, int]] = {}
    for pg_id, status in (trace.get("pg_status") or {}).items():
        if (name := name_of.get(str(pg_id))) is not None:
            # torch's -1 (nothing enqueued or completed yet) is 0 here: collective #0 does not exist
            out[name] = (max(0, int(status.get("last_enqueued_collective") or 0)),
                         max(0, int(status.get("last_completed_collective") or 0)))
    return out


def _completed_by_group(status: dict[str, tuple[int, int]], entries: list[dict[str, Any]]) -> dict[str, int]:
    """Per group name, the last collective known to have completed: ``pg_status``'s, or any later entry whose
    state says completed."""
    done = {name: completed for name, (_, completed) in status.items()}
    for e in entries:
        if e.get("state") == "completed":
            name = _group(e) or DEFAULT_GROUP
            done[name] = max(done.get(name, 0), int(e.get("collective_seq_id") or 0))
    return done


def _dropped_first_unfinished(out: list[dict[str, Any]], done: dict[str, int],
                              status: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    """For a group whose first unfinished collective fell out of the ring (its oldest entry left is a later one),
    that collective as ``pg_status`` knows it: its group and number, not its kind or size. It was enqueued
    before every entry the ring still holds, so it goes first."""
    oldest: dict[str, int] = {}
    for c in out:
        oldest.setdefault(c["group"], c["seq"])
    return [{"group": g, "seq": done.get(g, 0) + 1, "op": None, "sizes": [], "bytes": None, "completed": False}
            for g, (enqueued, _) in status.items()
            if g in oldest and done.get(g, 0) + 1 < oldest[g] and enqueued > done.get(g, 0)]


def _group(e: dict[str, Any]) -> str | None:
    group = e.get("process_group")
    return str(group[0]) if isinstance(group, (list, tuple)) and group else None


def _desc(e: dict[str, Any]) -> str:
    group = e.get("process_group")
    return str(group[1]) if isinstance(group, (list, tuple)) and len(group) > 1 else ""


def _ranks(text: Any) -> list[int] | None:
    """A group's global ranks, as torch writes them (``"[0, 1]"``); None when absent or unreadable."""
    try:
        ranks = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        return None
    if isinstance(ranks, (list, tuple)) and ranks and all(isinstance(r, int) for r in ranks):
        return [int(r) for r in ranks]
    return None


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
