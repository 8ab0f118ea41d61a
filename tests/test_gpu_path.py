"""The CUDA/NCCL branches, checked on CPU: torch's fake process group (works complete at enqueue, as NCCL's do),
recorders in place of ``torch.cuda`` and ``fully_shard``, synthetic CUDA-shaped traces. Tests marked ``gpu`` need a
real GPU and are skipped without one: ``pytest -m gpu tests/test_gpu_path.py`` runs them where one is lent."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddptrain.models.attention as attention
from ddptrain.config.choices import Precision
from ddptrain.config.schema import MetricsConfig, ModelConfig, ParallelConfig
from ddptrain.data import BatchShape
from ddptrain.data.loader import TokenCount
from ddptrain.models import build_model
from ddptrain.parallel import wrap_model
from ddptrain.telemetry.metrics import StepMetrics, TokenFlops
from tests.helpers.fake_cuda import A100, H100, RTX_4090, T4, V100, FakeGPU, fake_cuda
from tests.helpers.tiny import TINY_MODEL

TIME_FIGURES = ("comm_time_s", "overlap_pct", "algbw_gbps", "busbw_gbps", "time_exposed_comm_s")


@pytest.fixture(scope="module")
def fake_group() -> Iterator[int]:
    """An 8-rank fake process group in this process: every collective completes as soon as it is enqueued."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield 8
    dist.destroy_process_group()


def _one_sampled_step(parallel: ParallelConfig, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    wrapped = wrap_model(model, parallel, torch.device("cpu"))
    plan = BatchShape.derive(2 * world_size, 2, None, world_size, 4)
    meter = StepMetrics(plan, torch.device("cpu"), TokenFlops(1.0), MetricsConfig(sample_every=1), TokenCount())
    meter.start_step(1)
    with meter.timer.phase("backward"):
        wrapped.outer(torch.randn(4, 16)).sum().backward()
    meter.end_step(*wrapped.take_sync_sample(world_size, meter.timer.active))
    return meter.window(1, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("parallel", [ParallelConfig(compression="topk"), ParallelConfig(engine="bucketed")],
                         ids=["torch-ddp", "bucketed-engine"])
def test_no_time_or_bandwidth_figure_on_a_backend_whose_works_complete_at_enqueue(
    fake_group: int, parallel: ParallelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """On the fake backend (as on NCCL) the host clock sees only launches: bytes are logged, times are not."""
    with caplog.at_level(logging.WARNING):
        metrics = _one_sampled_step(parallel, fake_group)
    assert metrics["comm_bytes"] > 0
    assert not [k for k in TIME_FIGURES if k in metrics], metrics
    assert "gradient-sync timing is unavailable on backend 'fake'" in caplog.text


def _mismatched_all_reduce(rank: int, world_size: int) -> tuple[str, str]:
    from ddptrain.runtime.process_group import apply_debug_level

    apply_debug_level("detail")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))  # created after the level is set
    try:
        dist.all_reduce(torch.zeros(2 + rank), group=group)  # rank 0 sends 2 elements, rank 1 sends 3
    except RuntimeError as exc:
        return str(dist.get_debug_level()), str(exc)
    return str(dist.get_debug_level()), "no error"


def _two_rank_checks(rank: int, world_size: int) -> dict[str, object]:
    """Both multi-process checks in one process group (one spawn): data preparation first, then the debug level."""
    return {"prepare": _slow_then_failing_main(rank, world_size), "debug": _mismatched_all_reduce(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_two_rank_checks, 2, timeout=180)


def test_debug_detail_turns_a_collective_mismatch_into_torchs_readable_error(two_ranks: list[dict]) -> None:
    for level, error in (rank["debug"] for rank in two_ranks):
        assert level == "DebugLevel.DETAIL"
        assert "Detected mismatch between collectives on ranks" in error, error


@pytest.mark.parametrize(("precision", "device", "bf16"), [
    ("fp32", "cuda", False), ("auto", "cuda", True), ("bf16", "cuda", True), ("auto", "cpu", False),
    ("auto", "t4", False),  # auto computes in fp16 on a GPU without bf16: FSDP2 then gathers fp32
])
def test_fsdp_mixed_precision_follows_train_precision(
    monkeypatch: pytest.MonkeyPatch, precision: str, device: str, bf16: bool
) -> None:
    """``train.precision=fp32`` on CUDA trains fp32 under FSDP2 too (it used to get bf16 whenever on CUDA)."""
    from ddptrain.parallel import zero

    calls: list[dict] = []
    monkeypatch.setattr(zero, "fully_shard", lambda module, **kwargs: calls.append(kwargs) or module)
    # this machine has no GPU: an A100 (compute capability 8) or a T4 (7.5, bf16 only emulated)
    fake_cuda(monkeypatch, T4 if device == "t4" else A100)
    device = "cuda" if device == "t4" else device
    zero.shard_model(nn.Linear(2, 2), ParallelConfig(zero_stage=3), torch.device(device), precision)
    policy = calls[-1].get("mp_policy")
    assert (policy is not None) == bf16
    if bf16:
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("gpu", [T4, V100, A100, RTX_4090, H100], ids=lambda gpu: gpu.name)
def test_flash_attention_is_chosen_only_on_compute_capability_8_or_more(
    gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flash-attn refuses GPUs below sm80 at its first call ("FlashAttention only supports Ampere GPUs or newer"):
    a T4 or V100 with the package installed keeps sdpa for packed rows, in fp16 (what auto resolves to there),
    with one line saying why; from 8.0 on FlashAttention-2 is chosen."""
    fake_cuda(monkeypatch, gpu)
    monkeypatch.setattr(attention, "is_flash_attn_2_available", lambda: True)  # flash-attn installed
    model = build_model(ModelConfig(**TINY_MODEL), 64, eos_id=0)
    chosen: list[str] = []
    monkeypatch.setattr(model, "set_attn_implementation", chosen.append)
    with caplog.at_level(logging.INFO, logger=attention.log.name):
        switched = attention.use_varlen_attention(model, torch.device("cuda", 0), Precision.fp16)
    flash = gpu.capability >= (8, 0)
    assert switched == flash and chosen == (["flash_attention_2"] if flash else [])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    if not flash:
        major, minor = gpu.capability
        assert f"compute capability {major}.{minor}" in lines[0] and "sdpa" in lines[0] and gpu.name in lines[0]


def test_cpu_offload_joins_a_group_with_gloo_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloaded gradient shards (and their norm) are CPU tensors: NCCL alone cannot reduce them."""
    from ddptrain.config.schema import DistConfig
    from ddptrain.runtime.process_group import DistEnv, init_process_group

    seen: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: seen.append(backend))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    for offload in (True, False):
        init_process_group(DistConfig(), env, torch.device("cuda", 0), cpu_collectives=offload)
    init_process_group(DistConfig(), env, torch.device("cpu"), cpu_collectives=True)
    assert seen == ["cuda:nccl,cpu:gloo", "nccl", "gloo"]


def test_a_worker_asks_for_cpu_collectives_exactly_with_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from ddptrain.app import launch
    from ddptrain.config.compose import Run, build_config
    from ddptrain.runtime import process_group

    class Joined(Exception):
        pass

    seen: list[bool] = []

    def joining(_: object, cpu_collectives: bool = False, device: object = None) -> None:
        seen.append(cpu_collectives)
        raise Joined

    monkeypatch.setattr(process_group, "distributed", joining)  # run_worker imports it when called
    monkeypatch.setattr(launch, "validate_config", lambda *_: None)  # offload is refused without CUDA
    monkeypatch.setattr(launch, "setup_logging", lambda *_, **__: None)
    monkeypatch.setattr(launch, "ready_run_dir", lambda *_: None)  # the launcher's run-dir checks: not this test's
    for offload in (True, False):
        typed = build_config({"parallel": {"zero_stage": 3, "cpu_offload": offload}})
        with pytest.raises(Joined):
            launch.run_worker(Run(OmegaConf.create({}), typed, {}))
    assert seen == [True, False]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_worker_on_cuda_logs_the_allocator_line_at_start_up(device: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """``run_worker`` logs ``startup_line`` at INFO once its group and run dir exist, on a CUDA device only (both
    variables set: it names the one torch reads expandable segments from). Stopped before anything is built."""
    from contextlib import contextmanager

    from omegaconf import OmegaConf

    from ddptrain.app import launch
    from ddptrain.config.compose import Run, build_config
    from ddptrain.runtime import process_group
    from ddptrain.runtime.allocator import startup_line
    from ddptrain.runtime.process_group import DistEnv

    class Started(Exception):
        pass

    @contextmanager
    def joined(*_: object, **__: object) -> Iterator[tuple[DistEnv, torch.device]]:
        yield DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1), torch.device(device)

    def started(*_: object) -> None:
        raise Started

    environ = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(process_group, "distributed", joined)  # run_worker imports these when called
    monkeypatch.setattr(process_group, "shared_run_dir", lambda _: tmp_path)
    monkeypatch.setattr(launch, "setup_logging", lambda *_, **__: None)
    monkeypatch.setattr(launch, "Evidence", started)  # the line after the allocator's
    run = Run(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}}}), build_config({}), {})
    with caplog.at_level(logging.INFO, logger=launch.log.name), pytest.raises(Started):
        launch.run_worker(run)
    lines = [r.getMessage() for r in caplog.records if "allocator" in r.getMessage() and r.levelno >= logging.INFO]
    assert lines == ([startup_line(environ)] if device == "cuda" else [])
    assert device == "cpu" or "PYTORCH_ALLOC_CONF=expandable_segments:False (expandable segments off)" in lines[0]

class _Offloaded(nn.Module):
    """Parameters away from the compute device (as with CPU offload), a loss on the compute device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, device="meta"))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, use_cache: bool) -> object:
        return type("Output", (), {"loss": input_ids.float().mean()})()


def test_evaluation_reduces_on_the_runs_device_not_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import nullcontext

    from ddptrain.step.compute import evaluate

    reduced: list[torch.device] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *_, **__: reduced.append(tensor.device))
    val = evaluate(_Offloaded(), [torch.full((2, 3), 4)], nullcontext(), torch.device("cpu"))
    assert reduced == [torch.device("cpu")] and val == 4.0


def test_clipping_off_computes_the_norm_without_a_clipping_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddptrain.step.compute import clip_gradients

    model = nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *_, **__: pytest.fail("clipping pass with clip 0"))
    assert clip_gradients(model, 0.0) == pytest.approx(expected.item())


def test_at_default_settings_only_every_tenth_cuda_step_synchronizes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A timed step synchronizes at every phase boundary (15 times with 4 micro-steps): not at every step."""
    from ddptrain.config.schema import MetricsConfig
    from ddptrain.telemetry.timers import StepTimer

    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: syncs.append(1))
    with caplog.at_level(logging.INFO):
        timer = StepTimer(torch.device("cuda", 0), MetricsConfig().sample_every)
    per_step = []
    for step in range(1, 21):
        syncs.clear()
        timer.start_step(step)
        for _ in range(4):
            for phase in ("data", "forward", "backward"):
                with timer.phase(phase):
                    pass
        with timer.phase("optimizer"):
            pass
        timer.end_step()
        per_step.append(len(syncs))
    assert [s for s, n in enumerate(per_step, 1) if n] == [10, 20]
    assert per_step[9] == 2 + 2 * 13
    assert "the other steps run unsynchronized" in caplog.text


class _FakeCuda:
    """Stands in for the ``torch.cuda`` calls of the ring's stream plumbing and records them, thread by thread."""

    def __init__(self) -> None:
        import threading

        self.log: list[tuple] = []
        self.local = threading.local()
        self.compute = _FakeStream(self, "compute")

    def current(self) -> _FakeStream:
        return getattr(self.local, "stream", self.compute)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading
        from contextlib import contextmanager

        @contextmanager
        def stream(s: _FakeStream) -> Iterator[None]:
            before, self.local.stream = self.current(), s
            try:
                yield
            finally:
                self.local.stream = before

        def set_device(index: int) -> None:
            self.log.append(("set_device", threading.current_thread().name, index))

        cuda = torch.cuda
        monkeypatch.setattr(cuda, "set_device", set_device)
        monkeypatch.setattr(cuda, "Stream", lambda device=None: _FakeStream(self, "ring"))
        monkeypatch.setattr(cuda, "Event", lambda **_: _FakeEvent(self))
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: self.current())
        monkeypatch.setattr(cuda, "stream", stream)


class _FakeStream:
    def __init__(self, cuda: _FakeCuda, name: str) -> None:
        self.cuda, self.name, self.device = cuda, name, torch.device("cuda", 3)

    def wait_event(self, event: _FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.stream))


class _FakeEvent:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda, self.stream = cuda, ""

    def record(self, stream: _FakeStream | None = None) -> None:
        self.stream = (stream or self.cuda.current()).name
        self.cuda.log.append(("record", self.stream))


def test_ring_runs_on_its_own_stream_in_a_thread_bound_to_the_ranks_gpu(
    fake_group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defects 5 and 6: the ring thread sets its device before any CUDA call (no context on GPU 0 in every rank),
    and the ring's work goes to its own stream, ordered against compute by events, never onto the compute stream."""
    from ddptrain.comm import collectives

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    ring_streams: list[str] = []
    real_ring = collectives.ring_all_reduce
    monkeypatch.setattr(collectives, "ring_all_reduce",
                        lambda *args: ring_streams.append(cuda.current().name) or real_ring(*args))
    collectives._ring_thread.cache_clear()
    collectives._ring_stream.cache_clear()
    try:
        handle = collectives._launch_on_ring_stream(torch.ones(64), torch.device("cuda", 3), None)
        done_on: list[str] = []
        handle.add_done_callback(lambda: done_on.append(cuda.current().name))
        handle.wait()
    finally:
        collectives._ring_thread.cache_clear()
        collectives._ring_stream.cache_clear()
    log = [("set_device", "ddptrain-ring" in e[1], e[2]) if e[0] == "set_device" else e for e in cuda.log]
    assert log == [
        ("record", "compute"),  # launch: the gradient is ready once compute reaches here
        ("set_device", True, 3),  # the ring thread binds to the rank's GPU before any CUDA work
        ("wait", "ring", "compute"),  # the ring stream, not the compute stream, waits for the gradient
        ("record", "ring"),  # the ring's end, on its own stream
        ("wait", "compute", "ring"),  # the join: the compute stream waits on the device, not the host
    ]
    assert ring_streams == ["ring"] and done_on == ["ring"]


def _slow_then_failing_main(rank: int, world_size: int) -> list[str]:
    from ddptrain.errors import ConfigError
    from ddptrain.runtime.process_group import DistEnv, main_first

    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    store, gave_up = dist.distributed_c10d._get_default_store(), "the others gave up"

    def prepare() -> str:  # rank 0 prepares until the others have given up waiting: slower than their wait
        if rank == 0:
            store.wait([gave_up], timedelta(seconds=20))
        return "prepared"

    seen = []
    try:  # the others give up after 0.2 s with a message, not at the collective timeout
        seen.append(str(main_first(env, prepare, timeout_s=0.2)))
    except ConfigError as exc:
        seen.append(str(exc))
        store.set(gave_up, "")

    def refuse() -> str:
        raise ConfigError("data.paths: /nowhere: no such file")

    try:
        main_first(env, refuse, timeout_s=60)
    except ConfigError as exc:
        seen.append(str(exc))
    return seen


def test_ranks_waiting_for_data_preparation_stop_with_a_message_not_a_collective_timeout(
    two_ranks: list[dict],
) -> None:
    main, other = (rank["prepare"] for rank in two_ranks)
    assert main == ["prepared", "data.paths: /nowhere: no such file"]
    assert other[0].startswith("data.prepare_timeout_s=0.2: rank 1 waited that long for rank 0 to prepare the data")
    assert other[1] == "data.paths: /nowhere: no such file"


class _DeviceTimeline:
    """CUDA events on a made-up device clock: ``record()`` stamps the device time the test has set."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def event(self, **_: object) -> object:
        timeline = self

        class Event:
            def record(self, stream: object = None) -> None:
                self.ms = timeline.now_ms

            def elapsed_time(self, end: Event) -> float:
                return end.ms - self.ms

        return Event()


def test_on_cuda_sync_figures_come_from_device_events_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets on the device: 0-5 ms and 2-9 ms. In flight 9 ms; exposed 7 ms, from the last launch (the end
    of backward compute) to the end of the last collective, whatever the host clock saw."""
    from ddptrain.comm.clock import ClockKind, CommClock
    from ddptrain.parallel.compression import CommMeter

    device = _DeviceTimeline()
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    meter = CommMeter(CommClock(ClockKind.cuda, "nccl"))
    marks = {}
    for name, ms in (("a0", 0.0), ("b0", 2.0), ("a1", 5.0), ("b1", 9.0)):
        device.now_ms = ms
        marks[name] = meter.clock.mark()
    meter.spans += [(marks["a0"], marks["a1"]), (marks["b0"], marks["b1"])]
    comm_s, exposed_s = meter.timing()
    assert comm_s == pytest.approx(9e-3) and exposed_s == pytest.approx(7e-3)


@pytest.fixture
def nccl_group() -> Iterator[None]:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


# wrap_single: one rank trains the bare model unless asked to wrap it (the only GPU a test can count on)
# payload: torch DDP's comm hook sees every gradient; our engines count the bytes a rank sends (2(N-1)/N of the
# payload), none at world size 1 (an H200 run: 0.0), so their payload is known from N >= 2 ranks only
@pytest.mark.parametrize(("parallel", "sends_payload"), [
    (ParallelConfig(wrap_single=True), True),
    (ParallelConfig(engine="bucketed", bucket_cap_mb=1, wrap_single=True), False)],
    ids=["torch-ddp", "bucketed-engine"])
@pytest.mark.usefixtures("nccl_group")
@pytest.mark.gpu
def test_nccl_sync_is_timed_by_events_and_takes_device_time(parallel: ParallelConfig, sends_payload: bool) -> None:
    torch.cuda.set_device(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))).cuda()
    wrapped = wrap_model(model, parallel, torch.device("cuda", 0))
    assert wrapped.comm_clock() is not None and wrapped.comm_clock().kind == "cuda"
    for _ in range(3):
        start = time.perf_counter()
        wrapped.outer(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        sample, _ = wrapped.take_sync_sample(1, True)
    assert sample is not None and sample.comm_s is not None and sample.exposed_s is not None
    n_params = sum(p.numel() for p in model.parameters())
    # every fp32 gradient went through the sync
    assert sample.payload_bytes == pytest.approx(4 * n_params if sends_payload else 0.0)
    # against an independent clock: one all-reduce of the same bytes timed alone by its own events; the sync
    # (in buckets) takes at least half of that, and no longer than the host saw the whole step take
    flat, alone = torch.zeros(n_params, device="cuda"), []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dist.all_reduce(flat)
        end.record()
        torch.cuda.synchronize()
        alone.append(begin.elapsed_time(end) / 1e3)
    assert 0.5 * statistics.median(alone) <= sample.comm_s <= wall, (sample, alone, wall)
    assert 0 <= sample.exposed_s <= sample.comm_s


@pytest.mark.slow
@pytest.mark.gpu
def test_cpu_offload_and_fp32_fsdp_train_and_evaluate_on_a_gpu(tmp_path: Path) -> None:
    from tests.helpers.cli import run_cli

    for extra in (["parallel.cpu_offload=true", "optim.grad_clip=0"], ["train.precision=fp32"]):
        result = run_cli(["parallel.zero_stage=3", "train.steps=4", "train.eval_every=2", "train.log_every=2",
                          "data.max_documents=120", "dist.debug=detail", *extra],
                         cwd=tmp_path, cache=tmp_path / "cache", timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]


def test_a_wait_for_data_preparation_must_be_positive(tmp_path: Path) -> None:
    from ddptrain.app.preflight import validate_config
    from ddptrain.errors import ConfigError
    from tests.helpers.runs import make_config

    with pytest.raises(ConfigError, match=r"^data.prepare_timeout_s=0.0: expected a positive number of seconds$"):
        validate_config(make_config(str(tmp_path), {"data": {"prepare_timeout_s": 0}}), 1)
