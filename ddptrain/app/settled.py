"""A worker's end that no restart changes: once a worker of a launch has said its one line and exited with one of
``SAID_BY_WORKER``'s codes, the launch's later attempts end at once with the same code and say nothing.

Torch's elastic agent restarts every failed worker while restarts remain (``launch.max_restarts``; a replica
group's agent, ``ft.group_restarts``, 3 by default), whatever its exit code, and it has no public hook to tell a
refusal from a crash. A refused input (a model directory that cannot be loaded) is refused again by every attempt,
an abort on purpose (a non-finite step, drifted replicas) is what the user asked for: each attempt paid the
workers' start-up and printed the same line again (four times in about 30 s for a replica group). So the worker
that says the line records its code in ``<run dir>/ended.json`` with the launch's run id, and a restarted worker
of that launch finds it before composing the config and exits with it. The launcher removes the file when its
workers have ended (``app/launch.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Exit codes after which a worker has printed its own one line (cli.say_once): a refused input (2), an aborted
# non-finite step (3), replicas that drifted apart (4). The command exits with it, adding no line of its own.
SAID_BY_WORKER = frozenset({2, 3, 4})
SETTLED_FILE = "ended.json"
RUN_DIR_ENV = "DDPTRAIN_RUN_DIR"  # the run dir a launcher fixed for its workers


def _marker() -> Path | None:
    """This launch's marker, for a worker an elastic agent started with a run dir (None otherwise)."""
    run_dir, run_id = os.environ.get(RUN_DIR_ENV), os.environ.get("TORCHELASTIC_RUN_ID")
    return Path(run_dir) / SETTLED_FILE if run_dir and run_id else None


def record_settled(exit_code: int) -> None:
    """After a worker said its line: ``exit_code``, if no restart can change it, for this launch's later attempts."""
    if exit_code not in SAID_BY_WORKER or (path := _marker()) is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{SETTLED_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run_id": os.environ["TORCHELASTIC_RUN_ID"], "exit_code": exit_code}))
        tmp.replace(path)  # whole or absent: a restarted worker never reads half of it
    except OSError:  # the line is said; without the file a restart only repeats it
        pass


def settled_before() -> int | None:
    """In a restarted worker: the exit code an earlier attempt of this launch settled on (None: none did)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or (path := _marker()) is None:
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("run_id") != os.environ["TORCHELASTIC_RUN_ID"] or record.get("exit_code") not in SAID_BY_WORKER:
        return None  # another launch's
    return int(record["exit_code"])


def clear_settled(run_dir: Path) -> None:
    """The launcher's, once its workers have ended: the marker concerns this launch's attempts only."""
    (run_dir / SETTLED_FILE).unlink(missing_ok=True)
