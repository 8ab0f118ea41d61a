"""``python <this file> ARGS``: torchft's ``torchft_lighthouse`` console script, through its entry point, for an
environment that sees torchft but not its scripts (a venv laid over another's site-packages).

Run as a file, not ``-c`` or ``-m``: the lighthouse (Rust) reads the process's own arguments after the first, which
must then be this file's path."""

import sys
from importlib.metadata import entry_points

if __name__ == "__main__":
    (entry,) = entry_points(group="console_scripts", name="torchft_lighthouse")
    sys.exit(entry.load()())
