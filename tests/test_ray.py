"""``launch.backend=ray``: the run through Ray Train's ``TorchTrainer`` on a local Ray instance (2 CPU workers, one
per rank, gloo): the same losses, summary and W&B metrics as under torchrun; a worker killed after a checkpoint is
restarted by Ray (``FailureConfig``) and the run ends with the losses of an uninterrupted one. Without Ray, one
line names the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.worker_run import reference_losses

RUN = ["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
       "data.seq_len=32", "data.global_batch_size=8", "data.micro_batch_size=2", "train.steps=4", "train.log_every=1",
       "train.eval_every=0", "logger.progress=false", "checkpoint.every_n_steps=1", "checkpoint.export=false",
       "dist.timeout_s=60", "logger=wandb"]
RAY = ["launch.backend=ray", "launch.ray_workers=2"]
# Ray Train's controller polls its workers every 2 s by default: a worker's death and the run's end are seen 0.2 s
# after they happen instead; the preemption watcher (a process polling for node drains) and the state actor's
# reconciliation have nothing to watch on one machine; no usage report; the raylet does not prestart a worker per
# CPU (Train's actors carry a runtime environment of their own, so the prestarted ones were started for nothing:
# 14 Ray worker processes per kill test before, 12 without)
# (ddptrain itself turns the preemption watcher off on a local instance: test_a_local_instance_runs_no_preemption_...)
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
           "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
SAME = ("world_size", "global_batch_size", "micro_batch_size", "grad_accum", "steps", "first_step_loss",
        "first_logged_step", "first_logged_loss", "final_loss", "tokens_seen", "parameters", "wrapper", "skipped_steps")


def test_without_ray_the_run_is_refused_in_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddptrain.app.cli import run_cli as ddptrain_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as without the extra
    code = ddptrain_main([*RAY, "data=synthetic", f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["ddptrain: error: launch.backend=ray needs Ray Train, which is not installed: "
                                 "pip install 'ddptrain[ray]'"]


def test_the_ray_backend_is_ddptrains_own_choice_of_process_group() -> None:
    from ddptrain.app.ray_launch import ray_backend
    from ddptrain.config.compose import compose_config, typed_config
    from ddptrain.errors import ConfigError

    def backend(*overrides: str, gpu: bool) -> str:
        return ray_backend(typed_config(compose_config(list(overrides))).typed, gpu)

    assert (backend(gpu=False), backend(gpu=True)) == ("gloo", "nccl")
    assert backend("parallel=fsdp_offload", gpu=True) == "cuda:nccl,cpu:gloo"
    with pytest.raises(ConfigError, match=r"dist\.backend=nccl needs CUDA devices"):
        backend("dist.backend=nccl", gpu=False)


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _wandb_history(run: Path) -> list[dict]:
    (offline,) = (run / "wandb").glob("offline-run-*")
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(offline)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [r["history"]["item"] for r in map(json.loads, filter(str.strip, out.splitlines()))
            if r["type"] == "history"]


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run dir of the same run as one machine's 2 ranks, W&B's offline run in it. A reference, not what these
    tests guard (the Ray runs are): trained in forked ranks (``tests/helpers/worker_run.py``: a few CPU s
    instead of about 20 through the command), the same config, trainer and summary as the command's workers."""
    pytest.importorskip("ray.train.torch", reason="the extra ddptrain[ray] (Ray Train) is not installed")
    tmp = tmp_path_factory.mktemp("torchrun")
    reference_losses(RUN, 2, tmp / "run", tmp / "cache", environ={"WANDB_MODE": "offline"})
    return tmp / "run"


def test_a_local_instance_runs_no_preemption_watcher_unless_the_user_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train's preemption watcher has no node drains to see on one machine, and creating it logged
    "E ... core_worker.cc: Actor with class name: 'PreemptionWatcher' ... max_restarts > 0" on every run."""
    from ddptrain.app.ray_launch import PREEMPTION_WATCHER_ENV, local_instance_environment

    monkeypatch.delenv(PREEMPTION_WATCHER_ENV, raising=False)
    assert local_instance_environment({"A": "1"}, None) == {"A": "1", PREEMPTION_WATCHER_ENV: "0"}
    assert local_instance_environment({"A": "1"}, "ray://head:10001") == {"A": "1"}  # a cluster: Ray's default
    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, "1")
    assert local_instance_environment({"A": "1"}, None)[PREEMPTION_WATCHER_ENV] == "1"


@pytest.mark.slow
def test_ray_workers_train_as_torchruns_with_the_same_summary_and_wandb_metrics(
    tmp_path: Path, torchrun_reference: Path
) -> None:
    done = run_cli([*RUN, *RAY, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, cache=tmp_path / "cache",
                   timeout=400, extra_env=RAY_ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "run"
    assert _losses(run) == pytest.approx(_losses(torchrun_reference), rel=1e-6)
    got, expected = (json.loads((r / "summary.json").read_text()) for r in (run, torchrun_reference))
    assert got["wrapper"] == expected["wrapper"]
    assert {k: got[k] for k in SAME if k != "wrapper"} == pytest.approx(
        {k: expected[k] for k in SAME if k != "wrapper"}, rel=1e-6)
    assert got["world_size"] == 2 and got.keys() == expected.keys()
    ray_history, torchrun_history = _wandb_history(run), _wandb_history(torchrun_reference)
    assert [h["_step"] for h in ray_history] == [h["_step"] for h in torchrun_history] == [1, 2, 3, 4]
    assert [h["loss"] for h in ray_history] == pytest.approx([h["loss"] for h in torchrun_history], rel=1e-6)
    assert set(ray_history[-1]) == set(torchrun_history[-1])
    assert "checkpoint_manager_snapshot.json" in {p.name for p in run.iterdir()}  # Ray's record of the run's storage
    for noise in ("Traceback", "LOAD_GLOBAL", "Reporting training result", "State API", "RayTrainWorker pid=",
                  "PreemptionWatcher"):
        assert noise not in done.stderr, noise


@pytest.mark.slow
def test_a_ray_worker_killed_after_a_checkpoint_is_restarted_and_the_run_ends_with_the_same_losses(
    tmp_path: Path, torchrun_reference: Path
) -> None:
    done = run_cli([*RUN, *RAY, "launch.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                   cache=tmp_path / "cache", timeout=500, extra_env={**RAY_ENV, "DDPTRAIN_FAULT": "kill@step:3:1"})
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "run"
    assert "restarted by the elastic agent (or Ray Train)" in done.stderr, done.stderr[-4000:]
    assert "resumed from" in done.stderr and "step_000002 at step 2" in done.stderr
    assert _losses(run) == pytest.approx(_losses(torchrun_reference), rel=1e-6)
    goodput = json.loads((run / "summary.json").read_text())["goodput"]
    assert (goodput["attempts"], goodput["restarts"]) == (2, 1), goodput


def test_the_workers_get_the_drivers_allocator_settings_and_not_every_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker on another host of the cluster does not inherit the driver's environment: torch's caching allocator
    reads PYTORCH_ALLOC_CONF (and PYTORCH_CUDA_ALLOC_CONF) there, so they travel with the run."""
    from ddptrain.app.ray_launch import worker_environment
    from ddptrain.config.compose import compose_config, typed_config

    for key in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE", "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(key, raising=False)  # worker_environment sets them; restored after the test
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    # the driver's own Python install: a worker on another host has its own (no prefix wider than PYTORCH_)
    monkeypatch.setenv("PYTHONSTARTUP", "/home/driver/.pythonrc")
    monkeypatch.setenv("PYTHONUSERBASE", "/home/driver/.local")
    env = worker_environment(typed_config(compose_config(["data=synthetic"])).typed)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and "UNRELATED_SETTING" not in env
    assert "PYTHONSTARTUP" not in env and "PYTHONUSERBASE" not in env


class _Remote:
    """``ray.remote(...)(cls)``'s result, as far as ``fit`` uses it."""

    def remote(self) -> str:
        return "attempts-actor"


class _StubRay:
    def __init__(self) -> None:
        self.actors: list[type] = []

    def remote(self, **_: Any) -> Any:
        return lambda cls: self.actors.append(cls) or _Remote()


@pytest.mark.parametrize("code", [4, 3, 143])  # a drift abort, a non-finite abort, a stop on SIGTERM (128 + 15)
def test_a_ray_run_that_ended_on_purpose_exits_with_the_workers_code(
        code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run the workers ended on purpose (a drift abort: 4) reports its line and code to the driver, which exits
    with that code, not the 1 of a failure."""
    ray_torch = pytest.importorskip("ray.train.torch", reason="the extra ddptrain[ray] (Ray Train) is not installed")
    from ddptrain.app.ray_launch import fit
    from ddptrain.app.ray_worker import ENDED, EXIT_CODE
    from ddptrain.config.compose import compose_config, typed_config

    made: list[dict[str, Any]] = []

    class StubTrainer:
        def __init__(self, train_fn: Any, **kwargs: Any) -> None:
            made.append(kwargs)

        def fit(self) -> Any:
            return SimpleNamespace(metrics={ENDED: f"stopped on purpose ({code})", EXIT_CODE: code})

    monkeypatch.setattr(ray_torch, "TorchTrainer", StubTrainer)
    from ddptrain.app.ray_launch import Attempts

    cfg = typed_config(compose_config(["data=synthetic", "launch.max_restarts=2", "dist.timeout_s=90"])).typed
    ray = _StubRay()
    assert fit(ray, cfg, 2, False, tmp_path / "run", {}) == code
    assert capsys.readouterr().err.strip() == f"ddptrain: stopped on purpose ({code})"
    (kwargs,) = made
    assert kwargs["train_loop_config"]["attempts"] == "attempts-actor" and ray.actors == [Attempts]
    assert (kwargs["torch_config"].backend, kwargs["torch_config"].timeout_s) == ("gloo", 90)  # ddptrain's choices
    assert kwargs["run_config"].failure_config.max_failures == 2
    # Ray deletes none of ddptrain's checkpoints (ddptrain keeps its own: checkpoint.keep_last); None is also Ray's
    # default, asserted here as the library behaviour the explicit setting documents
    assert kwargs["run_config"].checkpoint_config.num_to_keep is None
    from ray.train import CheckpointConfig

    assert CheckpointConfig().num_to_keep is None


def test_the_workers_own_error_is_found_inside_rays_wrappers_by_cause_and_by_the_lowest_rank() -> None:
    """Ray wraps a worker's exception (``RayTaskError.cause``, or ``__cause__``) and a worker group error holds each
    rank's (``worker_failures``): the driver reports the lowest rank's own error, a ConfigError or RunEnded where
    the chain holds one, else the innermost error; a chain that loops ends."""
    from ddptrain.app.ray_launch import worker_error
    from ddptrain.errors import ConfigError, RunEnded

    class Wrapped(Exception):  # Ray's task error: the worker's exception in an attribute, no __cause__
        def __init__(self, cause: BaseException | None) -> None:
            super().__init__("wrapped")
            self.cause = cause

    refused = ConfigError("data.seq_len=0: expected at least 1")
    assert worker_error(Wrapped(refused)) is refused
    ended = RunEnded("stopped on purpose", 4)
    outer = RuntimeError("worker group failed")
    outer.__cause__ = Wrapped(ended)
    assert worker_error(outer) is ended
    innermost = ValueError("the rank's own bug")
    assert worker_error(Wrapped(Wrapped(innermost))) is innermost
    group = RuntimeError("group")
    group.worker_failures = {1: Wrapped(ValueError("rank 1")), 0: Wrapped(innermost)}  # type: ignore[attr-defined]
    assert worker_error(group) is innermost
    loop = Wrapped(None)
    loop.cause = loop
    assert worker_error(loop) is loop


def test_a_ray_worker_trains_its_rank_from_the_drivers_source_and_reports_the_summary_and_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_worker`` in-process with Ray's per-worker calls stubbed: it composes the driver's overrides (with
    train.resume=auto when Ray restored the run), trains through ``run_worker`` and reports the summary's scalars
    with rank 0's last committed checkpoint."""
    pytest.importorskip("ray.train.torch", reason="the extra ddptrain[ray] (Ray Train) is not installed")
    import ray
    import ray.train
    import ray.train.torch

    from ddptrain.app import launch, ray_worker
    from ddptrain.checkpoint.format import MARKER
    from ddptrain.config.compose import Source
    from ddptrain.errors import RunEnded

    for key in ("TORCHELASTIC_RESTART_COUNT", "GROUP_RANK", "DDPTRAIN_RUN_DIR", "DDPTRAIN_LAUNCH_START"):
        monkeypatch.setenv(key, "")  # train_worker sets them: restored after the test
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    last = run_dir / "checkpoints" / "step_000002"
    last.mkdir(parents=True)
    (last / MARKER).write_text("")
    reports: list[tuple[dict[str, Any], dict[str, Any]]] = []
    trained: list[tuple[Any, Any]] = []
    outcome: list[Any] = [{"final_loss": 2.5, "world_size": 2, "phases": {"forward": 1.0}}]

    def run_worker(run: Any, device: Any) -> dict[str, Any]:
        trained.append((run, device))
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    context = SimpleNamespace(get_world_rank=lambda: 0, get_node_rank=lambda: 0)
    monkeypatch.setattr(ray.train, "get_context", lambda: context)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: "restored")
    monkeypatch.setattr(ray.train, "report", lambda metrics, **kw: reports.append((metrics, kw)))
    monkeypatch.setattr(ray, "get", lambda attempt: 0)
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: "cpu-device")
    monkeypatch.setattr(launch, "run_worker", run_worker)
    attempts = SimpleNamespace(start=SimpleNamespace(remote=lambda rank: rank))
    config = {"source": Source(overrides=["data=synthetic", "train.steps=2"]), "run_dir": str(run_dir),
              "cwd": str(tmp_path), "launch_start": "0", "attempts": attempts}
    ray_worker.train_worker(config)
    ((run, device),) = trained
    assert device == "cpu-device" and run.typed.train.steps == 2 and run.typed.train.resume == "auto"
    ((metrics, extra),) = reports
    assert metrics == {"final_loss": 2.5, "world_size": 2}  # the summary's scalars only
    assert set(extra) == {"checkpoint", "checkpoint_upload_mode"} and extra["checkpoint"].path.endswith(last.name)
    outcome[0] = RunEnded("stopped on purpose", 4)
    ray_worker.train_worker(config)
    assert reports[-1] == ({ray_worker.ENDED: "stopped on purpose", ray_worker.EXIT_CODE: 4}, {})


# (os.cpu_count(), workers, the local instance's CPUs): the machine's CPUs, a CPU per worker where the machine has
# fewer, one where Python cannot tell (cpu_count() None)
@pytest.mark.parametrize(("cpus", "workers", "num_cpus"), [(8, 2, 8), (1, 2, 2), (None, 1, 1)])
def test_the_driver_starts_a_small_local_instance_and_hands_the_workers_the_run(
        cpus: int | None, workers: int, num_cpus: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_ray`` in-process, Ray and the trainer stubbed: a local instance gets a CPU per worker (at least),
    a small object store and no dashboard; the workers get the source, the absolute run dir (made) and the cwd."""
    from ddptrain.app import ray_launch
    from ddptrain.config.compose import Source, compose_config, typed_config

    monkeypatch.setattr(ray_launch.os, "cpu_count", lambda: cpus)

    inits: list[dict[str, Any]] = []
    fitted: list[tuple[Any, ...]] = []
    stub = SimpleNamespace(init=lambda **kw: inits.append(kw), shutdown=lambda: None,
                           cluster_resources=lambda: {"CPU": 2.0}, LoggingConfig=lambda **kw: kw)
    monkeypatch.setattr(ray_launch, "import_ray", lambda: stub)
    monkeypatch.setattr(ray_launch, "fit", lambda *args: fitted.append(args) or 0)
    for key in ("DDPTRAIN_RUN_DIR", "DDPTRAIN_LAUNCH_START", "RAY_COLOR_PREFIX"):
        monkeypatch.setenv(key, "")  # launch_ray sets them: restored after the test
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    source = Source(overrides=["data=synthetic", "launch.backend=ray", f"launch.ray_workers={workers}",
                               "hydra.run.dir=run"])
    assert ray_launch.launch_ray(typed_config(compose_config(source.overrides)), source) == 0
    (init,) = inits
    assert init["object_store_memory"] == ray_launch.LOCAL_OBJECT_STORE_BYTES and init["include_dashboard"] is False
    assert init["num_cpus"] == num_cpus and init["address"] is None
    ((_, _, started, use_gpu, run_dir, loop),) = fitted
    assert (started, use_gpu, run_dir) == (workers, False, tmp_path / "run") and run_dir.is_dir()
    assert loop == {"source": source, "run_dir": str(tmp_path / "run"), "cwd": str(tmp_path),
                    "launch_start": loop["launch_start"]}
