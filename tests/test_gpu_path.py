"""The CUDA/NCCL branches, checked on CPU: torch's fake process group (works complete at enqueue, as NCCL's do),
recorders in place of ``torch.cuda`` and ``fully_shard``, synthetic CUDA-shaped traces. Tests marked ``gpu`` need a
real GPU and are skipped without one: ``pytest -m gpu tests/test_gpu_path.py`` runs them where one is lent."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import ParallelConfig
from ddptrain.data import BatchPlan
from ddptrain.parallel import wrap_model
from ddptrain.telemetry.metrics import StepMetrics

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
    plan = BatchPlan.derive(2 * world_size, 2, None, world_size, 4)
    meter = StepMetrics(plan, torch.device("cpu"), 1.0, None, None, 1)
    meter.start_step(1)
    with meter.timer.phase("backward"):
        wrapped.module(torch.randn(4, 16)).sum().backward()
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
