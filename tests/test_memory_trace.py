"""A training step traced on fake tensors peaks where the same step peaks on real CPU tensors, category by
category; the dry run prints it for the target device, recommends a configuration and writes plan.json."""

from __future__ import annotations

import copy
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.optim import impl_kwargs, param_groups
from ddptrain.parallel.zero import shard_model
from ddptrain.plan.memory_plan import (
    Allowances,
    PeakFit,
    compute_dtype,
    shard,
    target_device,
    this_machine,
    trace_peak,
)
from ddptrain.plan.memory_trace import (
    CATEGORIES,
    StepSetup,
    create_optimizer_state,
    fake_training_state,
    model_state_tensors,
    trace_step,
    training_model,
)
from ddptrain.plan.planner import build_plan
from tests.helpers.cli import run_cli
from tests.helpers.dist import run_distributed

VOCAB, BATCH, SEQ = 2048, 4, 64
REPO = Path(__file__).parents[1]


def small_config(arch: str = "llama", checkpointing: bool = False, lora: bool = False) -> Config:
    cfg = Config()
    if arch == "qwen3":  # the qwen3_tiny preset's shape: QK-norm, grouped-query attention, its own head_dim
        preset = OmegaConf.load(REPO / "configs" / "model" / "qwen3_tiny.yaml")
        cfg.model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg.model), preset))
    else:
        cfg.model.arch, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads = arch, 64, 2, 4
        cfg.model.num_kv_heads = 2 if arch == "llama" else None  # grouped-query attention where the arch has it
    cfg.model.gradient_checkpointing = checkpointing
    cfg.model.lora.enabled = lora
    cfg.data.seq_len = SEQ
    return cfg


def real_training_state(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = training_model(cfg.model, VOCAB)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=1e-3,
                                  **impl_kwargs(cfg.optim.impl, torch.device("cpu")))
    create_optimizer_state(optimizer, model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, optimizer, {"input_ids": ids, "labels": ids}


def allocator_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                   setup: StepSetup) -> int:
    """The CPU allocator's peak over one real step (torch.profiler's memory events), plus what was live before."""
    params, state = model_state_tensors(model, optimizer)
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*params, *state, *batch.values()]}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=setup.compute_dtype, enabled=setup.compute_dtype is not None):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = highest = 0
    for event in events:
        current += event.nbytes()
        highest = max(highest, current)
    return sum(live.values()) + highest


def assert_close(predicted: dict[str, float], measured: dict[str, float], peak: float) -> None:
    for category in CATEGORIES:  # within 2% of the category, or of the peak for a category near zero
        assert predicted[category] == pytest.approx(measured[category], rel=0.02, abs=0.001 * peak), category


CASES = [("llama", False, False), ("llama", True, False), ("llama", False, True), ("llama", True, True),
         ("gpt2", False, False), ("gpt2", True, False), ("gpt2", False, True),
         ("qwen3", False, False), ("qwen3", True, False), ("qwen3", False, True)]


@pytest.mark.parametrize(("arch", "checkpointing", "lora"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(None, marks=pytest.mark.slow),
                                   pytest.param(torch.float16, marks=pytest.mark.slow)], ids=["bf16", "fp32", "fp16"])
def test_fake_step_peaks_like_the_real_cpu_step_in_every_category(
    arch: str, checkpointing: bool, lora: bool, dtype: torch.dtype | None
) -> None:
    cfg = small_config(arch, checkpointing, lora)
    setup = StepSetup("cpu", dtype, cfg.optim.grad_clip)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, VOCAB, BATCH, "cpu", mode)
    with mode:
        fake_tracker, flash_calls = trace_step(model, optimizer, batch, setup)
    fake = fake_tracker.peak
    assert next(model.parameters()).__class__.__name__ == "FakeTensor"
    # attention ran a flash kernel in every block (and again in every recomputed block), never the math path
    assert flash_calls == cfg.model.num_layers * (2 if checkpointing else 1)

    real_model, real_optimizer, real_batch = real_training_state(cfg)
    real = trace_step(real_model, real_optimizer, real_batch, setup)[0].peak
    measured = allocator_peak(real_model, real_optimizer, real_batch, setup)
    # the tracker sees what the allocator sees (checkpointing also saves RNG states, a few kB, outside ops)
    assert real.peak == pytest.approx(measured, rel=0.01)
    assert fake.peak == pytest.approx(measured, rel=0.02)
    assert_close(fake.by_category, real.by_category, measured)
    assert fake.by_category["activations"] > 0 and fake.by_category["optimizer"] > 0


def test_the_fit_of_small_traces_predicts_a_full_trace_at_another_size() -> None:
    cfg = small_config()
    cfg.model.num_layers = 4
    device = target_device("cpu", None, None)
    for accum in (1, 2):
        fit = PeakFit.from_traces(cfg, VOCAB, False, accum, device)
        for micro_batch in (1, 6):
            full = trace_peak(cfg, VOCAB, micro_batch, False, 4, accum, device).peak
            assert sum(fit.at(micro_batch, 4).values()) == pytest.approx(full.peak, rel=0.02)


def test_precision_resolves_for_the_target_device_not_this_machine() -> None:
    assert compute_dtype("auto", target_device("h100", None, None)) == torch.bfloat16
    assert compute_dtype("auto", target_device("t4", None, None)) == torch.float16  # no bf16 on a T4
    assert compute_dtype("auto", target_device("v100", None, None)) == torch.float16
    assert compute_dtype("fp16", target_device("h100", None, None)) == torch.float16
    assert compute_dtype("fp32", target_device("t4", None, None)) is None
    assert compute_dtype("auto", target_device("cpu", None, None)) is None
    assert target_device("l4", 10.0, None).memory_gib == 10.0


@pytest.mark.parametrize(("gpu", "key"), [("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100_40gb"),
                                          ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("Tesla T4", "t4")])
def test_this_machines_gpu_is_planned_as_its_own_kind(gpu: str, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: gpu)
    assert this_machine() == key


def test_an_unknown_plan_device_is_a_one_line_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"plan.device='h1000': expected cpu or one of h200, h100"):
        target_device("h1000", None, None)


def window_peaks(prof: profile, starts: list[int]) -> list[int]:
    """The allocator's peak within each window that starts at a time in ``starts`` (and ends at the next)."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    peaks = [0] * len(starts)
    current = 0
    for event in events:
        current += event.nbytes()
        window = sum(event.start_ns() >= start for start in starts) - 1
        if window >= 0:
            peaks[window] = max(peaks[window], current)
    return peaks


def assert_within_stray(predicted: float, measured: float, stray: float) -> None:
    """Within 2%, or above by at most ``stray`` (one copy of the parameters): in some runs a gloo rank still
    holds such a buffer through its steps (the parameters' size under DDP, the embedding's once or twice under
    FSDP2; likely a construction-time or finished collective's buffer freed late; not explained yet)."""
    assert measured >= 0.98 * predicted
    assert measured <= 1.02 * predicted or measured - predicted <= stray * 1.02


def steady_peak(build: Callable[[], Callable[[], object]], steps: int = 3) -> int:
    """The lowest allocator peak of a few steady steps of the step function that ``build`` returns; all the
    state it builds is allocated inside the profiled window, DDP's and FSDP2's buffers included.

    On gloo a rank sometimes still holds buffers of the step before at its peak (gradient- or embedding-sized:
    likely a finished collective's, freed late); the lowest of a few peaks is the step's own.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        step()  # the first step builds DDP's buckets and FSDP2's buffers
        starts = []
        for _ in range(steps):
            gc.collect()
            dist.barrier()
            starts.append(time.time_ns())
            step()
    return min(window_peaks(prof, starts))


def _ddp_rank_peak(rank: int, world_size: int, cfg: Config, bucket_view: bool) -> dict[str, int]:
    setup = StepSetup("cpu", None, cfg.optim.grad_clip)
    trainable = []

    def build() -> Callable[[], object]:
        model, optimizer, batch = real_training_state(cfg)
        trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        return lambda: trace_step(ddp, optimizer, batch, setup)

    return {"peak": steady_peak(build), "trainable": trainable[0]}


@pytest.mark.parametrize(("lora", "bucket_view"), [(False, False), (True, False), (False, True)])
@pytest.mark.slow  # 2 ranks, and a loose bound in some runs (assert_within_stray)
def test_a_ddp_rank_peaks_at_the_single_rank_trace_plus_its_gradient_buckets(lora: bool, bucket_view: bool) -> None:
    cfg = small_config(lora=lora)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, VOCAB, BATCH, "cpu", mode)
    with mode:
        fake = trace_step(model, optimizer, batch, StepSetup("cpu", None, cfg.optim.grad_clip))[0].peak
    ranks = run_distributed(_ddp_rank_peak, 2, copy.deepcopy(cfg), bucket_view)
    buckets = Allowances.for_run(target_device("cpu", None, None), fake.by_category, 0, 2,
                                 4.0 * ranks[0]["trainable"], bucket_view)
    assert buckets.total > 0
    stray = fake.by_category["parameters"]
    for rank in ranks:
        assert_within_stray(fake.peak + buckets.total, rank["peak"], stray)


def _fsdp_rank_peak(rank: int, world_size: int, cfg: Config, grad_accum: int) -> int:
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
    setup = StepSetup("cpu", dtype, cfg.optim.grad_clip, grad_accum)

    def build() -> Callable[[], object]:
        torch.manual_seed(0)
        model = training_model(cfg.model, VOCAB)
        model.train()
        shard_model(model, cfg.parallel, torch.device("cpu"), cfg.train.precision)
        optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=1e-3,
                                      **impl_kwargs(cfg.optim.impl, torch.device("cpu")))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return lambda: trace_step(model, optimizer, {"input_ids": ids, "labels": ids}, setup)

    return steady_peak(build)


@pytest.mark.parametrize(("stage", "precision", "grad_accum"),
                         [(2, "bf16", 1), (3, "bf16", 1), (2, "fp32", 1), (3, "fp32", 1), (3, "bf16", 2)])
@pytest.mark.slow  # 2 ranks, and a loose bound in some runs (assert_within_stray)
def test_an_fsdp2_rank_peaks_as_the_sharded_single_rank_trace(stage: int, precision: str, grad_accum: int) -> None:
    cfg = small_config()
    cfg.model.num_layers, cfg.parallel.zero_stage, cfg.train.precision = 4, stage, precision
    cfg.model.vocab_size = cfg.data.vocab_size = VOCAB
    device = target_device("cpu", None, None)
    plan = build_plan(cfg, 2, None)
    working_copy = precision == "bf16"  # FSDP2 gathers bf16 parameters and computes on them
    traced = trace_peak(cfg, VOCAB, BATCH, False, 4, grad_accum, device, working_copy).peak
    predicted = sum(shard(traced.by_category, stage, 2, plan, grad_accum > 1).values())
    assert shard(traced.by_category, stage, 2, plan)["parameters"] == plan.memory[stage].params
    stray = 4.0 * plan.params  # one fp32 copy of the parameters
    for measured in run_distributed(_fsdp_rank_peak, 2, copy.deepcopy(cfg), grad_accum):
        assert_within_stray(predicted, measured, stray)


def test_dry_run_prints_the_traced_peak_and_writes_plan_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["launch.dry_run=true", "plan.device=t4", "plan.world_size=2", "data.seq_len=64",
                      "data.global_batch_size=16", "data.micro_batch_size=4", f"hydra.run.dir={run_dir}"],
                     cwd=tmp_path, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Peak memory per rank on t4" in result.stdout and "Recommendation: micro batch" in result.stdout
    assert "DDP gradient buckets" in result.stdout and "Precision: fp16 compute, loss-scaled" in result.stdout
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["device"] == "t4" and plan["compute_dtype"] == "float16"  # what train.precision=auto runs on a T4
    # the step was traced under fp16 autocast: its parameters' fp16 copies are held for backward
    assert plan["by_category"]["parameter copies"] > 0
    assert plan["peak_bytes_per_rank"] == sum(plan["by_category"].values()) > 0
    assert set(plan["by_category"]) == set(CATEGORIES)
    best = plan["recommendation"]
    assert best["micro_batch_size"] * best["grad_accum"] * 2 == 16
    assert abs(plan["fit_gap"]) < 0.02
