"""One rank of a ``launch.backend=ray`` run, inside a Ray Train worker (``TorchTrainer``'s train function).

Ray Train has started this process, set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and created the process group (gloo on CPU, NCCL on GPU) before calling
``train_worker``; ddptrain joins that group (``runtime.process_group.distributed``) and trains exactly as a torchrun
worker does, into the run directory the driver fixed (Ray's storage path for the run).

Restarts: after a worker fails, Ray's ``FailureConfig`` starts a new worker group and calls ``train_worker`` again.
ddptrain counts that attempt (one small actor the driver owns, since Ray gives no attempt number to the function)
and puts it where ddptrain reads an attempt, ``TORCHELASTIC_RESTART_COUNT``: a restarted rank resumes from the
newest committed checkpoint of the run dir (as ``train.resume=auto``), goodput counts the restart, and a test's
injected fault fires only in the first attempt, exactly as under torchrun's elastic agent.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from pathlib import Path
from typing import Any

ENDED, EXIT_CODE = "ddptrain_ended", "ddptrain_exit_code"  # a run that ended early on purpose, for the driver


class Attempts:
    """How many times each rank's train function has started: the attempt of the worker group (Ray restarts the
    whole group). Made a Ray actor by the driver (``ray.remote(num_cpus=0)(Attempts)``)."""

    def __init__(self) -> None:
        self.starts: dict[int, int] = {}

    def start(self, rank: int) -> int:
        self.starts[rank] = self.starts.get(rank, -1) + 1
        return self.starts[rank]


def train_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: train this rank, then report the run's summary (and its last checkpoint)
    to Ray. ``config``: ``source`` (the config's source, as composed by the driver), ``run_dir``, ``cwd``,
    ``launch_start``, ``attempts``."""
    import ray
    import ray.train
    from ray.train.torch import get_device

    from ddptrain.app.launch import run_worker
    from ddptrain.config.compose import Source, compose_config, typed_config
    from ddptrain.errors import RunEnded
    from ddptrain.telemetry.goodput import LAUNCH_START_ENV

    context = ray.train.get_context()
    attempt = ray.get(config["attempts"].start.remote(context.get_world_rank()))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    os.environ["GROUP_RANK"] = str(context.get_node_rank())  # ddptrain's node of this rank (torchrun's name)
    os.environ["DDPTRAIN_RUN_DIR"] = config["run_dir"]
    os.environ[LAUNCH_START_ENV] = config["launch_start"]
    if Path(config["cwd"]).is_dir():  # relative paths in the overrides mean what they meant to the driver
        os.chdir(config["cwd"])
    source: Source = config["source"]
    overrides = list(source.overrides)
    if attempt == 0 and ray.train.get_checkpoint() is not None and not _names_resume(overrides):
        overrides.append("train.resume=auto")  # Ray restored this run (same storage path and name)
    run = typed_config(compose_config(Source(source.user_dir, source.name, overrides)))
    try:
        summary = run_worker(run, device=get_device())
        quiet_ray_loggers()  # ddptrain's log has said it all: no record of the report below
    except RunEnded as exc:  # every rank ends alike (a stop, an aborted non-finite step): not a failure to retry
        ray.train.report({ENDED: str(exc), EXIT_CODE: exc.exit_code})
        return
    ray.train.report(_scalars(summary), **_last_checkpoint(Path(config["run_dir"]), run.typed.checkpoint.dir,
                                                            context.get_world_rank()))


def quiet_ray_loggers() -> None:
    """Ray's loggers in this process at WARNING: Ray Train sets its own levels on them, and ddptrain's log handler
    (on the root logger) would print their INFO records. Some are named by module, some by file path."""
    for name in list(logging.root.manager.loggerDict):
        if name == "ray" or name.startswith("ray.") or f"{os.sep}ray{os.sep}" in name:
            logging.getLogger(name).setLevel(logging.WARNING)


def _names_resume(overrides: list[str]) -> bool:
    return any(o.lstrip("+~").startswith("train.resume=") for o in overrides)


def _scalars(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's numbers and strings: what Ray keeps as the run's metrics."""
    plain = {k: v.value if isinstance(v, Enum) else v for k, v in summary.items()}
    return {k: v for k, v in plain.items() if isinstance(v, int | float | str | bool) or v is None}


def _last_checkpoint(run_dir: Path, subdir: str, rank: int) -> dict[str, Any]:
    """The run's last committed checkpoint as Ray's checkpoint (rank 0's report carries it; it lies in Ray's
    storage already, the run dir, so nothing is copied)."""
    from ray.train import Checkpoint, CheckpointUploadMode

    from ddptrain.checkpoint.format import committed

    found = committed(run_dir / subdir)
    if rank != 0 or not found:
        return {}
    return {"checkpoint": Checkpoint.from_directory(str(found[-1])),
            "checkpoint_upload_mode": CheckpointUploadMode.NO_UPLOAD}
