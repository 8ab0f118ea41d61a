"""Every run writes its planned peak memory per rank beside the peak it measured, in summary.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ddptrain.config.choices import Precision
from ddptrain.config.schema import Config
from ddptrain.plan.memory import own_peak
from ddptrain.plan.memory.planner import compute_dtype
from ddptrain.plan.memory.present import this_device
from ddptrain.runtime.process_group import device_precision
from ddptrain.telemetry.measured_peak import MeasuredPeak
from tests.helpers.dist import run_distributed
from tests.helpers.fake_cuda import A100, H100, L4, T4, V100, FakeGPU, fake_cuda
from tests.helpers.pretrained import TINY_LLAMA
from tests.helpers.runs import Overrides, train_each

# Each run trains through the real loop, which writes summary.json; ranks are forked (tests/helpers/dist.py), and
# one rank group trains every variant of a test in turn, so no run pays a fresh interpreter's imports.
TINY: Overrides = {
    "data": {"max_documents": 40, "global_batch_size": 4},
    "model": {"num_layers": 1, "hidden_size": 64},
    "train": {"steps": 2, "log_every": 1, "eval_every": 0},
    "checkpoint": {"every_n_steps": 0},
}


def _written_peaks(rank: int, world_size: int, tmp: str, base: Overrides, variants: list[Overrides]) -> list[dict]:
    """For ``run_distributed``: train each variant; rank 0 returns the memory peaks each run wrote to summary.json."""
    runs = train_each(rank, world_size, tmp, base, variants, trace_peak=True)
    if rank != 0:
        return []
    return [json.loads((Path(run["dir"]) / "summary.json").read_text())["memory_peak"] for run in runs]


def test_a_one_rank_cpu_run_records_its_planned_and_measured_peak_within_2_percent(tmp_path: Path) -> None:
    micro_batches = (4, 2)
    written = run_distributed(_written_peaks, 1, str(tmp_path), TINY,
                              [{"data": {"micro_batch_size": m}} for m in micro_batches])[0]
    peaks = dict(zip(micro_batches, written, strict=True))
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
    from ddptrain.plan.analytic.planner import build_plan

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


def test_a_two_rank_ddp_run_plans_its_gradient_buckets_too(tmp_path: Path) -> None:
    two_ranks: Overrides = {"data": {"max_documents": 40, "global_batch_size": 8, "micro_batch_size": 4}}
    peaks = run_distributed(_written_peaks, 2, str(tmp_path), {**TINY, **two_ranks},
                            [{"parallel": {"gradient_as_bucket_view": view}} for view in (False, True)])[0]
    assert len(peaks) == 2  # one run with gradients as views into DDP's buckets, one without
    for peak in peaks:
        assert "DDP's gradient buckets" in peak["planned_by"]
        assert peak["measured_bytes"] == pytest.approx(peak["planned_bytes"], rel=0.02)


@pytest.mark.parametrize(("gpu", "expected"), [
    (H100, Precision.bf16), (A100, Precision.bf16), (L4, Precision.bf16), (T4, Precision.fp16), (V100, Precision.fp16),
], ids=lambda v: getattr(v, "name", str(v)))
def test_a_run_resolves_auto_on_its_gpu_as_the_planner_plans_that_gpu(
    monkeypatch: pytest.MonkeyPatch, gpu: FakeGPU, expected: Precision
) -> None:
    fake_cuda(monkeypatch, gpu)  # this machine has no GPU: torch.cuda answers as the named one would
    run = device_precision("auto", torch.device("cuda", 0))
    planned = compute_dtype("auto", this_device(torch.device("cuda", 0)))
    assert run == expected
    assert planned == {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}[run]
    # torch's default check counts a GPU that only emulates bf16: on a T4 it says yes (the run used to take bf16)
    assert torch.cuda.is_bf16_supported()
    assert device_precision("fp32", torch.device("cuda", 0)) == Precision.fp32
    assert device_precision("auto", torch.device("cpu")) == Precision.fp32


def _no_bf16(precision: str, device: torch.device) -> Precision:
    """What ``device_precision`` answers on a GPU without bf16 (tested above), for this machine's CPU."""
    return Precision.fp16 if precision == Precision.auto else Precision(precision)


def _train_as_on_a_gpu_without_bf16(rank: int, world_size: int, tmp: str) -> list[dict]:
    from ddptrain.train import trainer

    trainer.device_precision = own_peak.device_precision = _no_bf16  # this forked rank only
    run = {"model": {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "max_position_embeddings": 64},
           "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 32,
                    "global_batch_size": 4, "micro_batch_size": 4},
           "train": {"steps": 2, "log_every": 1, "eval_every": 0, "precision": "auto"},
           "checkpoint": {"every_n_steps": 0}}
    return train_each(rank, world_size, tmp, run, [{}], trace_peak=True)


def test_the_run_and_its_own_plan_both_follow_the_devices_resolution_of_auto(tmp_path: Path) -> None:
    summary = run_distributed(_train_as_on_a_gpu_without_bf16, 1, str(tmp_path))[0][0]["summary"]
    assert "loss_scale" in summary  # the run computed in fp16, with its loss scaler
    peak = summary["memory_peak"]
    assert peak["planned_by"].endswith("fp16")  # and the plan traced fp16: planned as run
    assert peak["measured_bytes"] == pytest.approx(peak["planned_bytes"], rel=0.02)


def test_a_qlora_cpu_run_plans_its_4bit_base_and_measures_within_2_percent(pretrained_base: Path, tmp_path: Path
                                                                           ) -> None:
    shape = {"arch": "llama", "hidden_size": TINY_LLAMA["hidden_size"], "num_heads": TINY_LLAMA["num_attention_heads"],
             "intermediate_size": TINY_LLAMA["intermediate_size"], "num_layers": TINY_LLAMA["num_hidden_layers"],
             "num_kv_heads": TINY_LLAMA["num_key_value_heads"], "tie_embeddings": False,
             "max_position_embeddings": TINY_LLAMA["max_position_embeddings"]}  # model.* describing the saved base
    run: Overrides = {
        "model": {**shape, "pretrained": str(pretrained_base), "quantize": "nf4", "lora": {"enabled": True, "r": 4}},
        "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 64,
                 "global_batch_size": 8, "micro_batch_size": 8},
        "train": {"steps": 2, "log_every": 1, "eval_every": 0}, "checkpoint": {"every_n_steps": 0},
    }
    (peak,) = run_distributed(_written_peaks, 1, str(tmp_path), run, [{}])[0]
    assert "traced step" in peak["planned_by"] and "PeakTracker" in peak["measured_by"]  # planned, not skipped
    assert peak["measured_bytes"] == pytest.approx(peak["planned_bytes"], rel=0.02)


def test_a_plannable_run_gets_its_traced_peak_in_process_and_sharding_lowers_it() -> None:
    """``planned_peak`` unmocked, in this process (the runs above plan in their forked ranks, which mutmut's stats
    do not see): a figure and how it was made; ZeRO-3 over 2 ranks plans less per rank than one rank's DDP."""
    from ddptrain.plan.analytic.planner import build_plan

    cfg = Config()
    cfg.model.vocab_size = 8192
    n_params = round(build_plan(cfg, 1, None).params)
    before = copy.deepcopy(cfg)
    alone, how = own_peak.planned_peak(cfg, 1, torch.device("cpu"), 8192, n_params)
    assert alone is not None and alone > 0 and how == "traced step on one rank, ZeRO-0 sharding for 1 ranks, fp32"
    assert cfg == before  # the run's own config is not the traced one's (precision resolved, the world size set)
    cfg.parallel.zero_stage = 3
    sharded, how = own_peak.planned_peak(cfg, 2, torch.device("cpu"), 8192, n_params)
    assert sharded is not None and sharded < alone and how.startswith("traced step on one rank, ZeRO-3 sharding for 2")
