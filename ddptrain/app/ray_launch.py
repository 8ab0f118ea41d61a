"""``launch.backend=ray``: the run's workers through Ray Train's ``TorchTrainer`` on a Ray cluster.

One Ray worker per rank (``ScalingConfig(num_workers=launch.ray_workers, use_gpu=...)``), the process group Ray
sets up (``TorchConfig``: NCCL on GPU, gloo on CPU, or what ``dist.backend`` names; ``dist.timeout_s``), the run
directory as Ray's storage for the run (``RunConfig(storage_path=<its parent>, name=<its name>)``: ddptrain's
checkpoints are the run's checkpoints), and ``FailureConfig(max_failures=launch.max_restarts)``: after a worker
fails Ray starts the workers again and they continue from the newest committed checkpoint
(``ddptrain/app/ray_worker.py``). The cluster is ``launch.ray_address``, else ``$RAY_ADDRESS``, else a Ray
instance started on this machine for the run (and stopped after it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ddptrain.app.preflight import validate_config
from ddptrain.app.ray_worker import ENDED, EXIT_CODE, Attempts, train_worker
from ddptrain.config.compose import Run, Source
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError, RunEnded, say
from ddptrain.telemetry.goodput import LAUNCH_START_ENV, launcher_start

EXTRA = "launch.backend=ray needs Ray Train, which is not installed: pip install 'ddptrain[ray]'"
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # ddptrain passes nothing large through Ray's object store
# the driver's variables a worker needs (on another host of the cluster it would not inherit them): PYTORCH_ holds
# the caching allocator's settings (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF: ddptrain's expandable segments or
# the user's own), read by torch when the worker first allocates on its device
FORWARDED = ("DDPTRAIN_", "WANDB_", "HF_", "TRANSFORMERS_", "TORCH_", "PYTORCH_", "NCCL_", "PYTHONPATH",
             "TOKENIZERS_PARALLELISM")


def import_ray() -> Any:
    try:
        import ray
        import ray.train.torch  # the TorchTrainer of the extra
    except ImportError as exc:
        raise ConfigError(EXTRA) from exc
    return ray


def ray_backend(cfg: Config, use_gpu: bool) -> str:
    """The process group's backend, as ddptrain chooses it for a torchrun worker (``runtime.process_group``)."""
    import torch

    from ddptrain.runtime.process_group import pick_backend

    return pick_backend(cfg.dist, torch.device("cuda" if use_gpu else "cpu"), cfg.parallel.cpu_offload)


def worker_environment(cfg: Config) -> dict[str, str]:
    """The variables every Ray worker starts with: the driver's that ddptrain, torch, NCCL, W&B and Hugging Face
    read, and torch's debug level and flight recorder, which act on process groups created after they are set
    (Ray creates the group before ddptrain runs)."""
    from ddptrain.diagnose.evidence import enable_flight_recorder

    if cfg.dist.debug != "off":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = str(cfg.dist.debug).upper()
    enable_flight_recorder(cfg.dist.flight_recorder)
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
    # Ray Train sends print() in the train function to the root logger, where ddptrain's log handler would show
    # what libraries print into their own buffers (datasets disassembles functions to fingerprint them)
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    return env


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def local_instance_environment(env: dict[str, str], address: str | None) -> dict[str, str]:
    """``env`` for the job's processes (Ray Train's controller among them), and on a local instance of our own
    (no ``address``) without Ray Train's preemption watcher: one machine has no node drains for it to see, and
    creating its actor logged an error line on every run (``E ... core_worker.cc: Actor with class name:
    'PreemptionWatcher' ... has constructor arguments in the object store and max_restarts > 0``). A value the
    user set is kept; on a cluster the watcher stays Ray's default."""
    if address:
        return env
    return {**env, PREEMPTION_WATCHER_ENV: os.environ.get(PREEMPTION_WATCHER_ENV, "0")}


def launch_ray(run: Run, source: Source) -> int:
    """Train through Ray Train; the exit code of the run (one line on failure, as under torchrun)."""
    ray = import_ray()
    typed = run.typed
    workers = typed.launch.ray_workers or typed.launch.nproc_per_node
    validate_config(typed, workers)  # fail here once, not in every worker
    run_dir = Path(os.path.abspath(run.cfg.hydra.run.dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["DDPTRAIN_RUN_DIR"] = str(run_dir)
    start = launcher_start()
    os.environ[LAUNCH_START_ENV] = start
    address = typed.launch.ray_address or os.environ.get("RAY_ADDRESS")
    env = local_instance_environment(worker_environment(typed), address)
    # a local instance for this run: no dashboard (ray[train] lacks its modules; it would only cost a process)
    local = {} if address else {"num_cpus": max(workers, os.cpu_count() or 1),
                                "object_store_memory": LOCAL_OBJECT_STORE_BYTES, "include_dashboard": False}
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # the workers' lines in the driver's log, without colour codes
    # Ray's own processes (the controller, its placement-group cleaner) report only errors: without Ray's dashboard
    # (not part of ray[train]) the cleaner warns every second that the state API is unavailable
    ray.init(address=address, runtime_env={"env_vars": env}, logging_level=logging.WARNING,
             logging_config=ray.LoggingConfig(log_level="ERROR"), **local)
    try:
        use_gpu = typed.launch.ray_use_gpu
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return fit(ray, typed, workers, use_gpu, run_dir, {"source": source, "run_dir": str(run_dir),
                                                         "cwd": os.getcwd(), "launch_start": start})
    finally:
        ray.shutdown()


def fit(ray: Any, cfg: Config, workers: int, use_gpu: bool, run_dir: Path, loop_config: dict[str, Any]) -> int:
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    attempts = ray.remote(num_cpus=0)(Attempts).remote()
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={**loop_config, "attempts": attempts},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        torch_config=TorchConfig(backend=ray_backend(cfg, use_gpu), timeout_s=int(cfg.dist.timeout_s)),
        run_config=RunConfig(
            name=run_dir.name, storage_path=str(run_dir.parent),
            failure_config=FailureConfig(max_failures=cfg.launch.max_restarts),
            # ddptrain keeps its own checkpoints (checkpoint.keep_last); Ray deletes none of them
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            logging_config=LoggingConfig(log_level="WARNING")),  # ddptrain's own log says what Ray Train's would
    )
    try:
        result = trainer.fit()
    except TrainingFailedError as exc:
        error = worker_error(exc)
        if isinstance(error, ConfigError):
            say(f"ddptrain: error: {error}")
            return 2
        say(f"ddptrain: error: the Ray workers failed{' after ' if cfg.launch.max_restarts else ''}"
            f"{f'{cfg.launch.max_restarts} restart(s)' if cfg.launch.max_restarts else ''}: {one_line_of(error)} "
            f"(run dir {run_dir}; continue with train.resume=auto)")
        return 1
    metrics = result.metrics or {}
    if ENDED in metrics:
        say(f"ddptrain: {metrics[ENDED]}")
        return int(metrics[EXIT_CODE])
    return 0


def worker_error(exc: BaseException) -> BaseException:
    """The exception a worker raised, out of Ray's wrappers (a worker group error holds each rank's)."""
    failures = getattr(exc, "worker_failures", None) or {}
    error: BaseException = failures[min(failures)] if failures else exc
    seen = set()
    while id(error) not in seen:  # Ray wraps the user's exception; the cause chain leads to it
        seen.add(id(error))
        if isinstance(error, ConfigError | RunEnded):
            return error
        inner = error.__cause__ or getattr(error, "cause", None)
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error


def one_line_of(error: BaseException) -> str:
    """The error's last line (a traceback's is its message), with its type."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"
