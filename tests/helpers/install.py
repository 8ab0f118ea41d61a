"""ddptrain installed afresh into a throwaway virtual environment, as a user's ``pip install`` lays it out, offline.

The environment sees the packages of the one the tests run in (torch, Hydra, ... through a ``.pth`` line naming
its site-packages: a plain path entry, so that environment's own ``.pth`` files, among them its editable install
of ddptrain, are not run) and nothing of the checkout; ddptrain itself is built from a clean copy of the checkout
(a build/ left in the checkout by an earlier build could ship files that no longer exist) and installed without
its dependencies, so nothing is downloaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).parents[2]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "outputs",
                                    "wandb", ".pytest_cache", ".ruff_cache")


def throwaway_install(root: Path, editable: bool = False) -> Path:
    """A venv under ``root`` with ddptrain installed from a clean copy of the checkout (``pip install .``, or
    ``pip install -e .``): its ``bin``."""
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    return venv_with(source, root / "venv", editable)


def venv_with(source: Path, venv: Path, editable: bool) -> Path:
    """A new venv at ``venv`` that sees the tested environment's packages, with ddptrain installed from
    ``source`` as it is (``scripts/mutate.py`` installs its mutated copy editable): the venv's ``bin``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "tested_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the venv's own python runs pip (seen through the .pth line), so the console scripts are the venv's;
    # --ignore-installed: the tested environment's ddptrain is not this one's to replace
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--ignore-installed", *(["-e"] if editable else []), str(source)],
                   check=True, capture_output=True, timeout=300, cwd=venv.parent)
    return venv / "bin"
