"""ddptrain: a Hydra-driven data-parallel training launcher for PyTorch."""

import time as _time

# When ddptrain's own code began in this process: the first line any entry point (``ddptrain``, ``python -m
# ddptrain``, a worker) runs. Goodput counts a launch from here rather than from the process's start, which a
# ``sh -c '... && exec ddptrain ...'`` wrapper's earlier work (pip install, data copies) shares: exec keeps the PID.
ENTERED_AT = _time.time()
