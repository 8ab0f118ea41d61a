"""Session-wide test settings (some must be in place before any test module imports its libraries), the one GPU
skip, and the fixtures many tests share."""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import collector

# Cached bytecode for the suite's own process (and each xdist worker): with PYTHONDONTWRITEBYTECODE=1 in the shell
# (set on the shared development machine), every run compiled ddptrain's modules again and pytest rewrote the
# asserts of every test module again, 6.7 of the 20 CPU s a collection costs, paid by each worker. Bytecode lands in
# the ignored __pycache__ folders; the commands the tests start keep the environment they were given.
sys.dont_write_bytecode = False

# Python's cyclic collector is off while the test modules import, on again once they are collected (or at once in
# pytest-xdist's controller, which collects nothing): tests/helpers/collector.py says why
gc.disable()

if TYPE_CHECKING:
    from ddptrain.config.schema import Config
    from tests.helpers.run_cache import RunCache

# Triton decides between compiling and interpreting when a kernel is first defined, and several libraries
# the suite imports (transformers, bitsandbytes, torch's inductor) import Triton on their own: so the
# interpreter, which runs our kernels on CPU tensors, is switched on here, before any of them.
# tests/test_kernels_gpu.py runs its CUDA checks in a fresh interpreter without it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# pytester: tests/test_layout.py runs small suites through these hooks; timing: each test's wall and CPU seconds and
# the fast tier's budget; xdist_groups: tests sharing a module fixture run on one pytest-xdist worker;
# package_marks: each test marked with the packages its file uses (pytest -m data); schedule: the longest work
# handed out first under xdist; procs: no process a test started outlives it; xdist_threads: each xdist worker's
# torch on its share of the cores
pytest_plugins = ["pytester", "tests.helpers.timing", "tests.helpers.xdist_groups", "tests.helpers.package_marks",
                  "tests.helpers.schedule", "tests.helpers.procs", "tests.helpers.xdist_threads"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one GPU skip: a test marked ``gpu`` needs a CUDA device and is skipped without one (``pytest -m gpu``
    runs them). Tests mark themselves; none checks for CUDA on its own."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    """pytest-xdist's controller collects nothing: the collector is on again in it at once."""
    if session.config.pluginmanager.has_plugin("dsession"):
        gc.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    """A pytest-xdist worker ends without the interpreter's teardown (``_end_a_worker``); any other process (a run
    without xdist, xdist's controller) tears down as Python does, with what was frozen walked again, so that its
    last collection frees it (a binding library counts what is left at exit as leaked, and says so)."""
    if hasattr(config, "workerinput"):
        _WORKER_EXIT.append(0)
    else:
        gc.unfreeze()


_WORKER_EXIT: list[int] = []  # a pytest-xdist worker's exit status, once it has sent its end to the controller


def _end_a_worker() -> None:
    """A pytest-xdist worker's last exit handler: the process ends without the interpreter's teardown, through the
    product's own ``app/cli.py`` ``end_without_teardown`` (imported here, at exit: the tests loaded it long before).

    By the time the worker exits it has sent every report, and its end (``workerfinished``), to the controller,
    which judges the run from those reports, never from a worker's exit status (0 either way). What is left is the
    teardown, which freed everything the worker's tests kept (models, traces, in-process process groups) and walked
    it in a last collection: 6.5 s after the fast tier's last test (1.8 without that collection; under 1 s for a
    short selection). Registered at this module's import, it runs after the exit handlers of every library a test
    imported (multiprocessing's servers, torch's compile workers, W&B)."""
    if _WORKER_EXIT:
        from ddptrain.app.cli import end_without_teardown

        end_without_teardown(_WORKER_EXIT)


atexit.register(_end_a_worker)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where a selected test's module runs ranks through ``tests/helpers/dist.py``, its fork server starts and
    imports before the first test, not inside it (``warm_forkserver`` says why)."""
    collector.settle()
    dist = sys.modules.get("tests.helpers.dist")
    if dist is None or session.config.option.collectonly:
        return
    if any(getattr(getattr(item, "module", None), "run_distributed", None) is dist.run_distributed
           for item in session.items):
        dist.warm_forkserver()


@pytest.fixture
def compose() -> Callable[..., Config]:
    """Compose command-line overrides into the typed config a run gets, through the real path (Hydra's compose
    with our config groups, the schema's checks), as ``ddptrain`` itself does."""
    from ddptrain.config.compose import build_config, compose_config, job_config

    def composed(*overrides: str) -> Config:
        return build_config(job_config(compose_config(list(overrides))))

    return composed


@pytest.fixture(scope="session")
def pretrained_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny "pretrained" Llama and its tokenizer, saved with save_pretrained (what a user brings); loaded through
    ``model.pretrained`` as users load theirs."""
    from ddptrain.data.instruct import generated_instructions
    from ddptrain.data.tokenizer import train_bpe
    from tests.helpers.pretrained import save_tiny_llama

    out = tmp_path_factory.mktemp("pretrained_base")
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(400)], 320)
    save_tiny_llama(out, eos_id=tok.eos_token_id)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def cli_runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> RunCache:
    """The session's CLI runs, each distinct command line run once across all pytest-xdist workers
    (``tests/helpers/run_cache.py``). A test must not change a cached run's files: copy them first."""
    from tests.helpers.run_cache import RunCache, shared_root

    return RunCache(shared_root(tmp_path_factory, worker_id))


@pytest.fixture(scope="session")
def torchrun_run(cli_runs: RunCache) -> tuple[Path, Path]:
    """A finished 2-step run of 2 ranks under plain torchrun, with no ``hydra.run.dir`` (rank 0's clock names the
    one run dir, under ``outputs/``) and a checkpoint: (its run dir, its data cache). Tests must not change it."""
    args = ["train.steps=2", "train.log_every=1", "data.max_documents=60", "data.global_batch_size=4",
            "data.micro_batch_size=2", "model.num_layers=1", "logger.progress=false", "checkpoint.export=false"]
    result = cli_runs.run(args, torchrun_nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((result.cwd / "outputs").rglob("summary.json"))
    assert len(runs) == 1, f"expected one run dir shared by both ranks, got {runs}"
    return runs[0].parent, cli_runs.data_cache


# What ddptrain's launcher sets in its own process for the workers it spawns (app/launch.py): an in-process launch
# in one test must not hand them to a later test's ranks (a leaked DDPTRAIN_LAUNCH_START made a later run's goodput
# count from that test's launch, 928 s before).
# The same for what a worker's evidence sets for torch's flight recorder (diagnose/evidence.py) and torchft's Manager
# re-points: a dump prefix left by one test made a later verdict test read its NCCL dump from elsewhere.
_LAUNCHER_ENV = ("DDPTRAIN_RUN_DIR", "DDPTRAIN_LAUNCH_START", "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.fixture(autouse=True)
def _launcher_environment_put_back() -> Iterator[None]:
    before = {name: os.environ.get(name) for name in _LAUNCHER_ENV}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

