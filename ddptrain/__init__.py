"""ddptrain: a Hydra-driven data-parallel training launcher for PyTorch."""

import os as _os
import time as _time

# When ddptrain's own code began in this process: the first line any entry point (``ddptrain``, ``python -m
# ddptrain``, a worker) runs. Goodput counts a launch from here rather than from the process's start, which a
# ``sh -c '... && exec ddptrain ...'`` wrapper's earlier work (pip install, data copies) shares: exec keeps the PID.
ENTERED_AT = _time.time()


def _forked() -> None:
    # A forked child (a fork server's rank, a multiprocessing worker) begins at the fork, not when its parent
    # imported ddptrain: without this its goodput counted the parent's whole life as its start-up.
    global ENTERED_AT
    ENTERED_AT = _time.time()


_os.register_at_fork(after_in_child=_forked)
