"""The Dockerfile lints clean, is laid out as its comments say, and its Python steps build the package from exactly
what its COPY lines take (no Docker engine runs here: the image itself is never built)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers.docker_context import ContextError, assemble, ignore_patterns, ignored, pip_step

ROOT = Path(__file__).parents[1]
PACKAGE_STEP = "pip install --no-deps ."  # the image's step that builds and installs the package


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, as (keyword, arguments), continuation lines joined, comments out."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", joined, re.M)]


def _apt_packages() -> set[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return {word for line in re.findall(r"apt-get install ([^&\n]*)", text) for word in line.split()}


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
    install = text.index("pip install --no-deps .")
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
    packages = _apt_packages()
    venv = re.search(r"\b(python3\.\d+) -m venv\b", text)
    assert venv, "no venv made from a versioned Python"
    missing = {"gcc", "g++", "libc6-dev", f"{venv.group(1)}-dev"} - packages
    assert not missing, f"the image lacks {sorted(missing)}"
    probe = text[text.index("pip install --no-deps ."):]
    assert "#include <Python.h>" in probe and "'gcc'" in probe and "sysconfig.get_paths()['include']" in probe


def test_the_dependencies_install_from_pyproject_before_any_source_is_copied() -> None:
    """Docker reuses a layer until an instruction's inputs change: the dependencies install in a layer whose only
    input is pyproject.toml, so a change to the source rebuilds the package alone, not the dependencies."""
    steps = _instructions()
    copies = {i: args.split() for i, (key, args) in enumerate(steps) if key == "COPY"}
    pyproject = [i for i, args in copies.items() if "pyproject.toml" in args]
    assert pyproject and copies[pyproject[0]] == ["pyproject.toml", "./"], "pyproject.toml is copied with others"
    first_source = min(i for i in copies if i != pyproject[0])
    deps = [i for i, (key, args) in enumerate(steps) if key == "RUN" and "pip install -r" in args]
    assert deps and pyproject[0] < deps[0] < first_source, "the dependencies do not install before the source"
    package = [i for i, (key, args) in enumerate(steps) if key == "RUN" and "pip install --no-deps ." in args]
    assert package and package[0] > max(copies), "the package installs before all of it is copied"
    runs = [args for key, args in steps[first_source:] if key == "RUN"]
    reinstalls = [args for args in runs if re.search(r"pip install (?!--no-deps)", args)]
    assert not reinstalls, "a pip install after the source is copied resolves dependencies again"

def test_the_dependency_list_the_image_installs_is_pyprojects(tmp_path: Path) -> None:
    """The very command the image runs on pyproject.toml (run here with this Python) lists its dependencies and the
    ft extra's."""
    run = next(args for key, args in _instructions() if key == "RUN" and "pip install -r" in args)
    command = re.search(r'python -c "([^"]+)"', run)
    assert command and "pyproject.toml" in command.group(1)
    listed = subprocess.run([sys.executable, "-c", command.group(1)], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    declared = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert declared
    extra = re.search(r'^ft = \[(.*?)\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra
    # the dependencies, then the ft extra: ddptrain-k8s --replica-groups starts torchft_lighthouse from this image
    assert listed == re.findall(r'^\s*"([^"]+)"', declared.group(1), re.M) + re.findall(r'"([^"]+)"', extra.group(1))
    assert "torchft==0.2.0" in listed
    assert "torch==" + re.search(r"ARG TORCH_VERSION=([\d.]+)", (ROOT / "Dockerfile").read_text()).group(1) in listed


def test_the_image_has_the_infiniband_userspace_nccl_needs_and_checks_it_loads() -> None:
    """Without libibverbs and its providers NCCL quietly uses TCP sockets on an InfiniBand/RoCE cluster; the
    build loads the verbs library and the ConnectX (mlx5) provider, so a missing one fails the build."""
    missing = {"rdma-core", "libibverbs1", "ibverbs-providers", "ibverbs-utils"} - _apt_packages()
    assert not missing, f"the image lacks {sorted(missing)}"
    text = (ROOT / "Dockerfile").read_text()
    assert "ctypes.CDLL('libibverbs.so.1')" in text and "ctypes.CDLL('libmlx5.so.1')" in text


def test_the_container_docs_give_what_a_multi_node_run_needs() -> None:
    docs = (ROOT / "docs" / "multinode.md").read_text()
    for needed in ("--network=host", "--ipc=host", "--shm-size", "--device=/dev/infiniband", "--ulimit memlock=-1",
                   "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NET/IB", "NCCL_DEBUG=INFO"):
        assert needed in docs, f"docs/multinode.md does not mention {needed}"


def package_files(root: Path) -> dict[str, str]:
    """What the wheel of the project at ``root`` must hold, from its pyproject: every module of every package listed
    and the package data, as {path in the wheel: path in the source tree}; and the readme pip reads."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    dirs, data = setuptools.get("package-dir", {}), setuptools.get("package-data", {})
    files = {}
    for package in setuptools["packages"]:
        source = Path(dirs.get(package, package.replace(".", "/")))
        inside = package.replace(".", "/")
        modules = [p.name for p in sorted((root / source).glob("*.py"))]
        globbed = {p.relative_to(root / source).as_posix() for pattern in data.get(package, [])
                   for p in (root / source).glob(pattern) if p.is_file()}
        # a namespace package (hydra_plugins: Hydra scans it for plugins) holds no file of its own, only packages
        namespace = any(other.startswith(f"{package}.") for other in setuptools["packages"])
        assert modules or globbed or namespace, f"pyproject lists {package}, but {source} holds none of its files"
        files.update({f"{inside}/{name}": f"{source.as_posix()}/{name}" for name in [*modules, *sorted(globbed)]})
    return files


def image_context(into: Path, ignore: str | None = None) -> Path:
    """The image's working directory at its package step, holding what the COPY lines took (``ignore``: the
    ``.dockerignore`` text, default the repository's own)."""
    dockerignore = ROOT / ".dockerignore"
    if ignore is None:
        assert dockerignore.is_file(), "no .dockerignore: the whole checkout (.git, .venv) is the build context"
        ignore = dockerignore.read_text()
    return assemble(ROOT, into, (ROOT / "Dockerfile").read_text(), ignore, PACKAGE_STEP)


def missing_from_context(workdir: Path) -> list[str]:
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    return [source for source in [*package_files(ROOT).values(), "pyproject.toml", readme]
            if not (workdir / source).is_file()]


def test_the_build_context_holds_every_file_the_package_needs(tmp_path: Path) -> None:
    """Every module and config the pyproject ships (the Hydra launcher plugin too) reaches the image's working
    directory before its package step, through the COPY lines and past .dockerignore."""
    workdir = image_context(tmp_path)
    needed = package_files(ROOT)
    assert any(p.startswith("hydra_plugins/ddptrain_launcher/") for p in needed)
    assert "ddptrain/configs/config.yaml" in needed
    assert missing_from_context(workdir) == []
    assert not (workdir / ".git").exists() and not list(workdir.rglob("__pycache__"))


def test_a_needed_file_the_dockerignore_drops_is_found_missing(tmp_path: Path) -> None:
    """The check honours .dockerignore: dropping some configs leaves them out of the context (pip would build a
    wheel without them), dropping a copied directory whole stops the build as Docker does."""
    ours = (ROOT / ".dockerignore").read_text()
    workdir = image_context(tmp_path / "a", ours + "\nconfigs/model/*.yaml\n")
    dropped = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs" / "model").glob("*.yaml"))
    assert dropped and missing_from_context(workdir) == dropped
    with pytest.raises(ContextError, match="'hydra_plugins' not found in the build context"):
        image_context(tmp_path / "b", ours + "\nhydra_plugins\n")


def test_dockerignore_patterns_follow_dockers_rules() -> None:
    patterns = ignore_patterns("# comment\n*\n!ddptrain\n**/__pycache__\n/configs/**/*.tmp\n!keep/a?.txt\n")
    assert ignored("tests/test_x.py", patterns) and ignored(".git/HEAD", patterns)
    assert not ignored("ddptrain/app/cli.py", patterns)  # re-included: the last match decides
    assert ignored("ddptrain/app/__pycache__/cli.cpython-311.pyc", patterns)  # ** across directories
    assert ignored("configs/a/b/x.tmp", patterns) and ignored("configs/x.tmp", patterns)
    assert not ignored("keep/ab.txt", patterns) and ignored("keep/abc.txt", patterns)  # ? is one character


@pytest.mark.slow
def test_the_images_pip_step_builds_a_wheel_with_every_package_and_the_launcher_plugin(tmp_path: Path) -> None:
    """The image's own package step, run as ``pip wheel`` with its options, in a directory holding only what the
    COPY lines took: it builds, and the wheel holds every package pyproject lists, the configs and the plugin."""
    workdir = image_context(tmp_path / "image")
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = pip_step(dockerfile, PACKAGE_STEP, tmp_path / "wheels")
    assert args[:3] == ["wheel", "--no-deps", "."]
    built = subprocess.run([sys.executable, "-m", "pip", *args], cwd=workdir, capture_output=True, text=True,
                           timeout=300)
    errors = [line.strip() for line in built.stdout.splitlines() + built.stderr.splitlines() if "error" in line]
    assert built.returncode == 0, "\n".join(errors) or built.stderr[-2000:]
    [wheel] = (tmp_path / "wheels").glob("ddptrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(package_files(ROOT)) - names)
    assert not missing, f"the wheel lacks {missing}"
    assert "hydra_plugins/ddptrain_launcher/ddptrain_launcher.py" in names
