"""``ft.json``: what each replica group did, read back from the groups' event files (``<run dir>/ft/group<G>.jsonl``,
written by each group's rank 0: one line per attempt, heal and step).

Per group: ``replica_id``, ``attempts`` (lives of its workers: the first and each restart by its own agent),
``heals`` (recoveries from a peer: the step it rejoined at and the seconds the copy took) and ``steps``, the steps
it took part in (committed), as ``[first, last]`` ranges. For the run: ``quorum_per_step`` as ``[first, last,
size]`` runs (the groups that took part in each committed step; under DiLoCo, in each step that closed a window
and synced) and ``quorum_lost`` (the group and step where a
quorum never came, if one did not).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddptrain.ft.layout import FT_DIR, FT_JSON, events_path


def read_events(path: Path) -> list[dict[str, Any]]:
    """A group's events; a line cut short by a kill (the last one) is left out."""
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def ranges(steps: Iterable[int]) -> list[list[int]]:
    """Sorted steps as ``[first, last]`` runs of consecutive steps: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return runs


def group_record(group: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    committed = [e["step"] for e in events if e.get("event") == "step" and e.get("committed")]
    return {
        "replica_id": group,
        "attempts": sum(1 for e in events if e.get("event") == "attempt"),
        "heals": [{"step": e["step"], "seconds": e["seconds"]} for e in events if e.get("event") == "heal"],
        "steps": ranges(committed),
        "steps_not_committed": sorted({e["step"] for e in events if e.get("event") == "step"
                                       and not e.get("committed")}),
    }


def quorum_runs(per_group: list[list[dict[str, Any]]]) -> list[list[int]]:
    """Each committed step's quorum size, as ``[first, last, size]`` runs (every group in it records the same).
    Under DiLoCo the groups meet only in the steps that close a window: only those have a size."""
    sizes: dict[int, int] = {}
    for events in per_group:
        for e in events:
            if e.get("event") == "step" and e.get("committed") and e.get("quorum") is not None:
                sizes[e["step"]] = e["quorum"]
    return size_runs(sizes)


def size_runs(sizes: dict[int, int]) -> list[list[int]]:
    """Each step's quorum size as ``[first, last, size]`` runs of consecutive steps of one size."""
    runs: list[list[int]] = []
    for step in sorted(sizes):
        if runs and runs[-1][1] == step - 1 and runs[-1][2] == sizes[step]:
            runs[-1][1] = step
        else:
            runs.append([step, step, sizes[step]])
    return runs


def ft_record(run_dir: Path, groups: int) -> dict[str, Any]:
    per_group = [read_events(events_path(run_dir, g)) for g in range(groups)]
    lost = [{"replica_id": g, "step": e["step"]} for g, events in enumerate(per_group) for e in events
            if e.get("event") == "quorum_lost"]
    return {"replica_groups": [group_record(g, events) for g, events in enumerate(per_group)],
            "quorum_per_step": quorum_runs(per_group), "quorum_lost": lost}


def write_ft_json(run_dir: Path, groups: int) -> dict[str, Any]:
    """``<run dir>/ft.json`` from the event files under ``<run dir>/ft/``; returns the record."""
    record = ft_record(run_dir, groups)
    (run_dir / FT_DIR).mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{FT_JSON}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(run_dir / FT_JSON)
    return record
