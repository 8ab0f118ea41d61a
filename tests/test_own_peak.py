"""Every run writes its planned peak memory per rank beside the peak it measured, in summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.config.schema import Config
from ddptrain.plan import own_peak
from ddptrain.plan.own_peak import MeasuredPeak
from tests.helpers.cli import run_cli

TINY = ["data.max_documents=40", "train.steps=2", "train.log_every=1", "train.eval_every=0", "model.num_layers=1",
        "model.hidden_size=64", "checkpoint.export=false", "checkpoint.every_n_steps=0", "logger.progress=false",
        "launch.nproc_per_node=1", "data.global_batch_size=4"]


def memory_peak(tmp_path: Path, micro_batch: int) -> dict:
    run_dir = tmp_path / f"run{micro_batch}"
    result = run_cli([*TINY, f"data.micro_batch_size={micro_batch}", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                     cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())["memory_peak"]


def test_a_one_rank_cpu_run_records_its_planned_and_measured_peak_within_2_percent(tmp_path: Path) -> None:
    peaks = {m: memory_peak(tmp_path, m) for m in (4, 2)}
    for peak in peaks.values():
        assert peak["measured_bytes"] == pytest.approx(peak["planned_bytes"], rel=0.02)
        assert "PeakTracker" in peak["measured_by"] and "traced step" in peak["planned_by"]
    # measured on the run's own step: half the micro batch (twice the accumulation) holds fewer activations
    assert peaks[2]["measured_bytes"] < 0.95 * peaks[4]["measured_bytes"]
    assert peaks[2]["planned_bytes"] < 0.95 * peaks[4]["planned_bytes"]


def test_configs_the_trace_cannot_model_are_skipped_with_the_reason() -> None:
    cfg = Config()
    cfg.train.compile = True
    planned = own_peak.planned_peak(cfg, 1, torch.device("cpu"), 2048, 0)
    assert planned == (None, "train.compile=true: the trace runs the eager step")
    cfg.train.compile, cfg.parallel.zero_stage, cfg.parallel.cpu_offload = False, 3, True
    assert own_peak.planned_peak(cfg, 2, torch.device("cpu"), 2048, 0)[0] is None
    cfg.parallel.zero_stage, cfg.parallel.cpu_offload = 0, False
    # model.* (llama_tiny by default) does not describe a model of 123 parameters: nothing to trace
    planned = own_peak.planned_peak(cfg, 1, torch.device("cpu"), 8192, 123)
    assert planned[0] is None and "the run's model has 123" in planned[1]


def test_a_failing_trace_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise RuntimeError("no fake kernel")

    monkeypatch.setattr(own_peak, "configured_peak", fail)
    cfg = Config()
    cfg.model.vocab_size = 8192
    from ddptrain.plan.planner import build_plan

    n_params = round(build_plan(cfg, 1, None).params)
    assert own_peak.planned_peak(cfg, 1, torch.device("cpu"), 8192, n_params) == (
        None, "the trace failed: RuntimeError: no fake kernel")


def test_the_cpu_measurement_tracks_one_steady_step_only() -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    measured = MeasuredPeak(torch.device("cpu"), model, optimizer, first_step=1, zero_stage=0)
    sizes = {}
    for step, rows in ((1, 4096), (2, 16), (3, 4096)):
        measured.begin(step)
        model(torch.randn(rows, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured.end(step)
        sizes[step] = measured.bytes
    assert sizes[1] is None and sizes[2] == sizes[3] and measured.result(3) == sizes[2]
    assert sizes[2] < 4096 * 64 * 4  # the small step's peak, not a large step's activations


@pytest.mark.slow  # 2 ranks
@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_two_rank_ddp_run_plans_its_gradient_buckets_too(tmp_path: Path, bucket_view: bool) -> None:
    run_dir = tmp_path / "run"
    args = [*(o for o in TINY if not o.startswith("launch.nproc_per_node")), "launch.nproc_per_node=2",
            "data.global_batch_size=8", "data.micro_batch_size=4",
            f"parallel.gradient_as_bucket_view={str(bucket_view).lower()}", f"hydra.run.dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    peak = json.loads((run_dir / "summary.json").read_text())["memory_peak"]
    assert "DDP's gradient buckets" in peak["planned_by"]
    assert peak["measured_bytes"] == pytest.approx(peak["planned_bytes"], rel=0.02)
