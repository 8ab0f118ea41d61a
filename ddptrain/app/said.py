"""A worker's last line said once for a run of several jobs: the replica groups of a local launch.

Each replica group is a job of its own (its own agent, its own rank 0), and a refusal its workers find after the
groups started (a model directory that cannot be loaded, a malformed data record) is found alike by every group:
every group's rank 0 said the same line, two lines for two groups. The groups' launcher (``app/ft_launch.py``)
gives its workers a folder, ``<run dir>/ft/said/``, emptied as each launch starts; a worker about to say its last
line first claims it there, as a file named by the line's hash, created only if it does not exist. The first
group to claim a line says it; the others stay silent. Lines that differ (they name their group) are all said.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

SAID_DIR_ENV = "DDPTRAIN_SAID_DIR"  # set by the groups' launcher: where its workers claim their lines


def first_to_say(line: str) -> bool:
    """Whether this process is the first of the launch to say ``line`` (always, outside a groups' launch). A
    folder that cannot be written to says yes: a line said twice is better than none."""
    folder = os.environ.get(SAID_DIR_ENV)
    if not folder:
        return True
    claim = Path(folder) / hashlib.sha256(line.encode()).hexdigest()[:32]
    try:
        claim.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def fresh_said_dir(folder: Path) -> Path:
    """The launch's claims folder, emptied of an earlier launch's claims (its lines are not this launch's)."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder
