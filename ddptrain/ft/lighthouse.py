"""The torchft lighthouse of a local run: the wheel's own lighthouse server, on a free port of this machine.

It keeps the quorum: which replica groups take part in each step. It is started before any group, its log goes to
``<run dir>/ft/lighthouse.log`` (torchft logs every quorum), and ``<run dir>/ft/lighthouse.json`` names its pid and
address (for the operator, and the tests that stop it)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddptrain.errors import ResourceError
from ddptrain.ft.layout import FT_DIR

READY_TIMEOUT_S = 30.0
JOIN_TIMEOUT_MS = 2000  # how long a quorum waits for a straggling group once ft.min_replicas have joined
HEARTBEAT_TIMEOUT_MS = 3000  # a group silent this long is out of the next quorum


def command() -> list[str]:
    """The lighthouse's function run by this interpreter without the ``torchft`` package's import (``lighthouse_entry``;
    the wheel's ``torchft_lighthouse`` script imports torch first: 1.9 CPU s, and seconds before the groups start)."""
    return [sys.executable, str(Path(__file__).with_name("lighthouse_entry.py"))]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class Lighthouse:
    """One lighthouse process for this run: ``start()``, ``address``, ``alive()``, ``stop()``."""

    def __init__(self, run_dir: Path, min_replicas: int) -> None:
        self.run_dir, self.min_replicas = run_dir, min_replicas
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> Lighthouse:
        """Start it and wait until it accepts connections; a lighthouse that exits first is a one-line error."""
        folder = self.run_dir / FT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        log_path = folder / "lighthouse.log"
        with log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [*command(), "--min_replicas", str(self.min_replicas), "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
                 "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--bind", f"[::]:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                code = self.process.poll()
                self.stop()
                why = f"exit code {code}" if code is not None else "no answer"
                raise ResourceError(f"the torchft lighthouse did not start on port {self.port} ({why}; see {log_path})")
            time.sleep(0.05)
        (folder / "lighthouse.json").write_text(json.dumps({"pid": self.process.pid, "address": self.address}))
        return self

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("localhost", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def exit_code(self) -> int | None:
        """None while it runs; its exit code once gone."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
