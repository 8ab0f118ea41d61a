"""A training step traced on fake tensors peaks where the same step peaks on real CPU tensors, category by
category; the dry run prints it for the target device, recommends a configuration and writes plan.json."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from ddptrain.app.cli import run_cli as ddptrain_main
from ddptrain.config.choices import ActivationCheckpointing
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.models.build import build_model
from ddptrain.models.chunked_loss import use_chunked_loss
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.optim import impl_kwargs, param_groups
from ddptrain.parallel.zero import shard_model
from ddptrain.plan.analytic.planner import build_plan
from ddptrain.plan.memory.overheads import RunOverheads
from ddptrain.plan.memory.planner import (
    AUTO_MARGIN,
    Allowances,
    GiB,
    LogitsShare,
    MemoryPlan,
    TracedStep,
    Tracer,
    compute_dtype,
    plan_memory,
    predicted_step_s,
    shard,
    target_device,
    this_machine,
    trace_peak,
)
from ddptrain.plan.memory.trace import (
    StepSetup,
    create_optimizer_state,
    fake_training_state,
    trace_step,
    training_model,
)
from ddptrain.telemetry.storage_peak import CATEGORIES, PeakTracker, model_state_tensors
from tests.helpers.dist import run_distributed
from tests.helpers.pretrained import TINY_LLAMA
from tests.helpers.trace_cache import share_traces, step_key

VOCAB, BATCH, SEQ = 2048, 4, 64
REPO = Path(__file__).parents[1]
MiB = 1 << 20


def small_config(arch: str = "llama", checkpointing: str = "none", lora: bool = False) -> Config:
    cfg = Config()
    if arch == "qwen3":  # the qwen3_tiny preset's shape: QK-norm, grouped-query attention, its own head_dim
        preset = OmegaConf.load(REPO / "configs" / "model" / "qwen3_tiny.yaml")
        cfg.model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg.model), preset))
    else:
        cfg.model.arch, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads = arch, 64, 2, 4
        cfg.model.num_kv_heads = 2 if arch == "llama" else None  # grouped-query attention where the arch has it
    cfg.model.activation_checkpointing = ActivationCheckpointing(checkpointing)
    cfg.model.lora.enabled = lora
    cfg.data.seq_len = SEQ
    return cfg


def with_run_loss(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """The loss the run computes: chunked (``train.chunked_loss``, on by default) where it is exact."""
    if cfg.train.chunked_loss:
        use_chunked_loss(model, cfg.train.loss_chunk_tokens)
    return model


def real_training_state(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = with_run_loss(training_model(cfg.model, VOCAB), cfg)
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


CASES = [("llama", "none", False), ("llama", "full", False), ("llama", "none", True), ("llama", "full", True),
         ("llama", "selective", True), ("gpt2", "none", False), ("gpt2", "full", False), ("gpt2", "none", True),
         ("gpt2", "selective", False), ("qwen3", "none", False), ("qwen3", "full", False), ("qwen3", "none", True),
         ("qwen3", "selective", False)]


@pytest.mark.parametrize(("arch", "checkpointing", "lora"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(None, marks=pytest.mark.slow),
                                   pytest.param(torch.float16, marks=pytest.mark.slow)], ids=["bf16", "fp32", "fp16"])
def test_fake_step_peaks_like_the_real_cpu_step_in_every_category(
    arch: str, checkpointing: str, lora: bool, dtype: torch.dtype | None
) -> None:
    cfg = small_config(arch, checkpointing, lora)
    setup = StepSetup("cpu", dtype, cfg.optim.grad_clip)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, VOCAB, BATCH, "cpu", mode)
    with mode:
        fake_tracker, flash_calls = trace_step(model, optimizer, batch, setup)
    fake = fake_tracker.peak
    assert next(model.parameters()).__class__.__name__ == "FakeTensor"
    # attention ran a flash kernel in every block (and again in every block full checkpointing recomputes; selective
    # checkpointing keeps its output), never the math path
    assert flash_calls == cfg.model.num_layers * (2 if checkpointing == "full" else 1)

    real_model, real_optimizer, real_batch = real_training_state(cfg)
    real = trace_step(real_model, real_optimizer, real_batch, setup)[0].peak
    measured = allocator_peak(real_model, real_optimizer, real_batch, setup)
    # the tracker sees what the allocator sees (checkpointing also saves RNG states, a few kB, outside ops)
    assert real.peak == pytest.approx(measured, rel=0.01)
    assert fake.peak == pytest.approx(measured, rel=0.02)
    assert_close(fake.by_category, real.by_category, measured)
    assert fake.by_category["activations"] > 0 and fake.by_category["optimizer"] > 0


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_prompt_completion_step_is_planned_with_the_attention_mask_the_real_step_holds(packing: bool) -> None:
    """Prompt/completion rows on SDPA carry a ``[rows, 1, T, T]`` attention mask that backward keeps (packed rows'
    block-diagonal one, padded rows' causal-and-padding one): the plan traces it as the run builds it (one per micro
    batch), so the traced peak is the real step's, category by category, at a length where the mask is a real part
    of it (rows of 256: 3% of the step's peak at 2 layers)."""
    from ddptrain.config.choices import DataFormat
    from ddptrain.models.attention import ready_attention_masks

    cfg = small_config("llama", "none", lora=True)
    cfg.data.seq_len = 256
    cfg.data.format, cfg.data.packing = DataFormat.prompt_completion, packing
    setup = StepSetup("cpu", torch.bfloat16, cfg.optim.grad_clip, data_format=cfg.data.format)  # the token mean
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, VOCAB, BATCH, "cpu", mode)
    assert set(batch) == {"input_ids", "labels", "position_ids" if packing else "attention_mask"}
    with mode:
        fake = trace_step(model, optimizer, batch, setup)[0].peak

    real_model, real_optimizer, _ = real_training_state(cfg)
    assert ready_attention_masks(real_model)  # as the run installs it
    ids = torch.randint(0, VOCAB, (BATCH, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    index = torch.arange(cfg.data.seq_len).expand(BATCH, -1)
    real_batch = {"input_ids": ids, "labels": ids,
                  **({"position_ids": index % 100} if packing  # examples of 100, 100 and 56 tokens in each row
                     else {"attention_mask": (index < torch.tensor([[256], [200], [150], [90]])).long()})}
    measured = allocator_peak(real_model, real_optimizer, real_batch, setup)
    assert fake.peak == pytest.approx(measured, rel=0.02)
    real = trace_step(real_model, real_optimizer, real_batch, setup)[0].peak
    assert_close(fake.by_category, real.by_category, measured)


@pytest.fixture(scope="module")
def shared_traces() -> Iterator[dict[str, Any]]:
    """The planner's traced steps, each traced once for the tests here that plan (a trace depends on the step,
    not on the device's memory size, the configured mode or train.compile: ``tests/helpers/trace_cache.py``)."""
    yield from share_traces()


def test_the_shared_traces_key_a_step_by_what_its_trace_reads() -> None:
    """``tests/helpers/trace_cache.py`` hands one trace to every step of the same key: the ZeRO stage (a trace is
    one rank's bare step, sharded after), the target's name and memory (an H100 and an RTX 4090 both trace in
    bf16 on ``cuda``) and ``metrics.peak_tflops`` (a MIG slice's throughput) leave the key and the trace alike to the
    byte; the target's kind and bf16 change both (the planner's matrix in test_plan_consistency.py shares its traces
    across targets, MIG slices and stages by this)."""
    cfg = small_config()
    staged = copy.deepcopy(cfg)
    staged.parallel.zero_stage, staged.parallel.bucket_cap_mb = 3, 1.0
    staged.metrics.peak_tflops = 141.3
    step = TracedStep(2, ActivationCheckpointing.none, 1, 2)
    h100, rtx4090, cpu = (target_device(name, None, None) for name in ("h100", "rtx4090", "cpu"))

    def traced(c: Config, device: Any) -> tuple[str, dict[str, dict[str, int]]]:
        tracker = trace_peak(c, VOCAB, step, device)  # the planner's own, imported before any fixture patched it
        return step_key(c, VOCAB, (step, device), {}), {p: dict(k.by_category) for p, k in tracker.phase_peaks.items()}

    (key, phases), (same_key, same_phases), (cpu_key, cpu_phases) = (
        traced(cfg, h100), traced(staged, rtx4090), traced(cfg, cpu))
    assert key == same_key and phases == same_phases
    assert cpu_key != key and cpu_phases != phases  # fp32 on the CPU: what the key keeps apart differs


def test_traces_on_one_kept_fake_model_equal_traces_on_a_fresh_one_to_the_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trace_peak``'s ``states`` (a Tracer's): the micro batches, accumulations and depths a planner asks for in
    turn, each traced on the fake model kept for its mode, depth, chunked loss and working copy, peak as on a
    freshly built one, every phase and category to the byte; and they were traced on kept models (one built
    per config and depth). A LoRA prompt/completion run on the CPU (its attention-mask hook, the
    host-read verdict of foreach AdamW) and GPT-2 under full checkpointing on an H100 (CUDA's autocast lists,
    fused AdamW, the bf16 working copy)."""
    import ddptrain.plan.memory.planner as memory_planner
    from ddptrain.config.choices import DataFormat

    built: list[int] = []
    build = memory_planner.fake_model_state
    monkeypatch.setattr(memory_planner, "fake_model_state", lambda *a, **k: built.append(1) or build(*a, **k))
    padded = small_config("llama", "selective", lora=True)
    padded.data.format, padded.data.packing = DataFormat.prompt_completion, False
    gpt2 = small_config("gpt2", "full")
    # (micro batch, depth, grad_accum) in turn: another micro batch, accumulation and depth on one states dict
    cases = ((padded, "cpu", False, ((3, 1, 2), (2, 1, 1))), (gpt2, "h100", True, ((3, 1, 2), (1, 2, 2), (2, 1, 1))))
    for cfg, device, working_copy, steps in cases:
        target, states = target_device(device, None, None), {}
        for m, depth, accum in steps:
            step = TracedStep(m, cfg.model.activation_checkpointing, depth, accum)
            kept = trace_peak(cfg, VOCAB, step, target, working_copy, states=states).phase_peaks
            fresh = trace_peak(cfg, VOCAB, step, target, working_copy).phase_peaks
            assert kept == fresh, (cfg.model.arch, step)
    assert len(built) == 3 + 5  # a kept model per config and depth; a fresh one per fresh trace


def test_the_tracker_answers_a_fake_tensors_device_query_itself_and_traces_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PeakTracker`` answers ``prim.device`` on a fake tensor itself (two of every three ops it sees in a traced
    step): none reaches the fake mode's dispatch, where without the shortcut over a thousand do, and every phase
    and category of the step is the same to the byte. GPT-2 under full checkpointing on an H100 (fused AdamW,
    CUDA's autocast lists, the bf16 working copy) and LoRA Llama on the CPU (foreach AdamW, clipping by device
    group)."""
    import ddptrain.telemetry.storage_peak as storage_peak

    queries: list[int] = []
    dispatch = FakeTensorMode.dispatch

    def counted(self: FakeTensorMode, func: Any, *args: Any, **kwargs: Any) -> Any:
        queries.append(func is torch.ops.prim.device.default)
        return dispatch(self, func, *args, **kwargs)

    cases = ((small_config("gpt2", "full"), "h100", True), (small_config("llama", "none", lora=True), "cpu", False))
    for cfg, device, working_copy in cases:
        target, states = target_device(device, None, None), {}
        step = TracedStep(2, cfg.model.activation_checkpointing, 1, 2)
        trace_peak(cfg, VOCAB, step, target, working_copy, states=states)  # the model built outside the count
        seen: dict[bool, tuple[int, dict]] = {}
        for shortcut in (True, False):
            with monkeypatch.context() as patch:
                patch.setattr(FakeTensorMode, "dispatch", counted)
                if not shortcut:  # the tracker passes the query on, as every other op
                    patch.setattr(storage_peak, "DEVICE", object())
                queries.clear()
                phases = trace_peak(cfg, VOCAB, step, target, working_copy, states=states).phase_peaks
            seen[shortcut] = (sum(queries), phases)
        assert seen[True][1] == seen[False][1], cfg.model.arch
        assert seen[True][0] == 0 and seen[False][0] > 1000, (cfg.model.arch, seen[True][0], seen[False][0])


def _grouped_devices(tensors: list[torch.Tensor]) -> list[str]:
    """The devices ``_group_tensors_by_device_and_dtype`` (foreach/fused optimizers, clipping) sorts ``tensors`` by."""
    return sorted(str(device) for device, _ in torch._C._group_tensors_by_device_and_dtype([tensors], False))


def test_a_fake_tensors_device_query_under_the_tracker_answers_its_own_device() -> None:
    """What the shortcut answers is the fake tensor's own device, index included, as without the tracker."""
    with FakeTensorMode():
        on_card, on_host = torch.empty(4, device="cuda:0"), torch.empty(4, device="cpu")
        bare = _grouped_devices([on_card, on_host])
        with PeakTracker() as tracker:
            card, host = torch.empty(4, device="cuda:0"), torch.empty(4, device="cpu")
            tracked = _grouped_devices([card, host])
    assert tracker.peak.peak == 32  # the tracker was on: it counted both new tensors
    assert bare == ["cpu", "cuda:0"]
    assert tracked == bare, f"under PeakTracker a fake tensor's device query answers {tracked}, not {bare}"


def test_a_tracer_keeps_one_fake_model_per_kind_and_each_step_traces_as_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One ``Tracer`` asked, in turn, for another micro batch, checkpointing mode, working copy and chunked loss
    than the step before: each peak, every phase and category, as a fresh model's; and the Tracer built one fake
    model per kind, the micro batches of a kind sharing theirs (GPT-2 on an H100: the bf16 working copy). A kept
    model is left with no gradient by its step (a later step on it would otherwise start beside them)."""
    import ddptrain.plan.memory.planner as memory_planner

    built: list[tuple] = []
    build = memory_planner.fake_model_state
    monkeypatch.setattr(memory_planner, "fake_model_state", lambda *a, **k: built.append(a[3:]) or build(*a, **k))
    monkeypatch.setattr(memory_planner, "trace_peak", trace_peak)  # the Tracer's own, not a shared_traces cache
    cfg, device = small_config("gpt2"), target_device("h100", None, None)
    none, full, chunked = ActivationCheckpointing.none, ActivationCheckpointing.full, cfg.train.chunked_loss
    tracer = Tracer(cfg, VOCAB, device)
    # (micro batch, mode, working copy, chunked loss): each differs from the one before in one of them
    steps = ((2, none, False, chunked), (1, none, False, chunked), (1, full, False, chunked),
             (1, none, True, chunked), (1, none, False, not chunked))
    kept = [tracer.phases(m, mode, 1, working, loss) for m, mode, working, loss in steps]
    assert len(built) == 4  # four kinds: the second micro batch traced on the first one's model
    for (m, mode, working, loss), phases in zip(steps, kept, strict=True):
        fresh = trace_peak(cfg, VOCAB, TracedStep(m, mode, 1, 2, loss), device, working).phase_peaks
        assert phases == {phase: peak.by_category for phase, peak in fresh.items()}, (m, mode, working, loss)
    # what the reuse relies on: a traced step leaves its kept model no gradient (the update clears them)
    states: dict[tuple, Any] = {}
    trace_peak(cfg, VOCAB, TracedStep(1, none, 1, 2), device, states=states)
    (_, model, _), = states.values()
    assert [p.grad for p in model.parameters() if p.grad is not None] == []
    assert any(p.requires_grad for p in model.parameters())


def test_the_fit_of_small_traces_predicts_a_full_trace_at_another_size(shared_traces: dict[str, Any]) -> None:
    """On the H100 the planner tests below plan for (bf16 autocast, the fused AdamW of a GPU): the small traces
    of the fit are theirs too."""
    cfg = small_config()
    cfg.model.num_layers = 4
    device = target_device("h100", None, None)
    fit = Tracer(cfg, VOCAB, device).fit(ActivationCheckpointing.none)
    for accum in (1, 2):
        for micro_batch in (1, 6):
            full = trace_peak(cfg, VOCAB, TracedStep(micro_batch, ActivationCheckpointing.none, 4, accum), device).peak
            assert sum(fit.at(micro_batch, 4, accum > 1).values()) == pytest.approx(full.peak, rel=0.02)


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


@contextlib.contextmanager
def every_thread_counted() -> Iterator[None]:
    """Have the CPU allocator count the frees made on every thread in ``total_allocated``.

    torch.profiler's memory events come from the profiled thread: a storage whose last reference another thread
    drops (a gloo worker finishing a collective) is freed with no event, so summing the events carries it as
    live for the rest of the profile. Under c10's ``caffe2_report_cpu_memory_usage`` flag the allocator keeps its
    running total for every thread, and each event carries that total (tested below). The flag is a global of
    libc10 with no Python setter; its INFO log lines stay below c10's default log level.
    """
    flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")),
                                "FLAGS_caffe2_report_cpu_memory_usage")
    flag.value = True
    try:
        yield
    finally:
        flag.value = False


def allocator_totals(prof: profile) -> list[tuple[int, int]]:
    """(time, the allocator's live bytes on every thread) at each allocation or free on the profiled thread."""
    totals = []

    def walk(event: Any) -> None:  # the profiler's event tree node
        if event.tag.name == "Allocation":
            totals.append((event.start_time_ns, event.extra_fields.total_allocated))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(totals)


def steady_peak(build: Callable[[], Callable[[], object]], steps: int = 3) -> list[int]:
    """The allocator's peak in each of a few steady steps of the step function that ``build`` returns, over
    what was live before ``build`` (everything it builds, DDP's and FSDP2's buffers included)."""
    with every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1)  # its event gives the allocator's total before build
        step = build()
        step()  # the first step builds DDP's buckets and FSDP2's buffers
        starts = []
        for _ in range(steps):
            gc.collect()
            dist.barrier()
            starts.append(time.time_ns())
            step()
    totals = allocator_totals(prof)
    before = totals[0][1] - 4
    peaks = [0] * steps
    for at, total in totals:
        window = sum(at >= start for start in starts) - 1
        if window >= 0:
            peaks[window] = max(peaks[window], total - before)
    return peaks


def _free_on_a_gloo_thread(rank: int, world_size: int, counted: bool) -> dict[str, Any]:
    main, freed_on = threading.get_ident(), []
    with every_thread_counted() if counted else contextlib.nullcontext(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if rank == 1:
            time.sleep(0.3)  # rank 0's all-reduce cannot finish before rank 0 drops its references
        buffer = torch.ones(MiB)  # 4 MiB of fp32
        weakref.finalize(buffer.untyped_storage(), lambda: freed_on.append(threading.get_ident()))
        work = dist.all_reduce(buffer, async_op=True)
        del buffer, work  # only gloo's worker thread holds the buffer now
        for _ in range(500):  # until the worker, done with the all-reduce, drops it
            if freed_on:
                break
            time.sleep(0.01)
        probe = torch.empty(1)  # its event carries the allocator's total after the free
    events = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    totals = allocator_totals(prof)
    del probe
    return {"freed_off_main": bool(freed_on) and freed_on[0] != main, "events_live": events,
            "total_live": totals[-1][1] - (totals[0][1] - 4 * MiB)}


@pytest.mark.slow  # 2 ranks
def test_a_buffer_freed_on_a_gloo_thread_is_missing_from_the_profilers_events_but_not_from_the_allocators_total(
) -> None:
    for counted in (False, True):
        rank0 = run_distributed(_free_on_a_gloo_thread, 2, counted)[0]
        assert rank0["freed_off_main"]  # the storage died, on gloo's worker thread
        assert rank0["events_live"] == 4 * MiB + 4  # ... yet no event frees it: summed events keep it live
        if counted:  # the allocator's own total, under the flag, has it freed
            assert rank0["total_live"] == 4


def test_profiling_every_thread_would_record_no_memory_events_at_all() -> None:
    """Why the 2-rank tests count gloo threads' frees through the allocator's total instead."""
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, experimental_config=config) as prof:
        torch.ones(MiB).sum()
    assert not [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]


def allocations(prof: profile) -> list[tuple[int, list[str]]]:
    """Each allocation on the profiled thread: its bytes and the ops it was made in, innermost first."""
    found = []

    def walk(event: Any, ops: list[str]) -> None:  # the profiler's event tree node
        if event.tag.name == "Allocation" and event.extra_fields.alloc_size > 0:
            found.append((event.extra_fields.alloc_size, ops[::-1]))
        for child in event.children:
            walk(child, [*ops, event.name])

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    return found


def _collective_buffers(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    model = training_model(cfg.model, VOCAB)
    state_bytes = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.nn.parallel.DistributedDataParallel(model)
        reduce_in, reduce_out = torch.ones(2 * 1000), torch.empty(1000)
        dist.reduce_scatter_tensor(reduce_out, reduce_in)
    made = allocations(prof)
    return {"state_bytes": state_bytes,
            "flattened": [size for size, ops in made if ops[:2] == ["aten::cat", "aten::flatten_dense_tensors"]],
            "reduce_scatter_copies": [size for size, ops in made if "c10d::_reduce_scatter_base_" in ops]}


@pytest.mark.slow  # 2 ranks
def test_ddp_and_gloo_make_the_buffers_that_gloo_threads_free(
) -> None:
    """What the allocator's total showed live after a step when a gloo thread freed it, in runs before the
    count covered every thread: DDP's broadcast of the module state at construction (one flattened copy of
    the parameters and buffers) and gloo's copy of a reduce-scatter's input (gloo reduces a copy, then keeps
    its rank's chunk; NCCL reduces the input in place)."""
    for rank in run_distributed(_collective_buffers, 2, small_config()):
        assert rank["flattened"] == [rank["state_bytes"]]
        assert rank["reduce_scatter_copies"] == [2 * 1000 * 4]


def _ddp_rank_peak(rank: int, world_size: int, cfg: Config, bucket_view: bool) -> dict[str, Any]:
    setup = StepSetup("cpu", None, cfg.optim.grad_clip)
    trainable = []

    def build() -> Callable[[], object]:
        model, optimizer, batch = real_training_state(cfg)
        trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        return lambda: trace_step(ddp, optimizer, batch, setup)

    return {"peak": steady_peak(build), "trainable": trainable[0]}


@pytest.mark.parametrize(("lora", "bucket_view"), [(False, False), (True, False), (False, True)])
@pytest.mark.slow  # 2 ranks
def test_a_ddp_rank_peaks_at_the_single_rank_trace_plus_its_gradient_buckets(lora: bool, bucket_view: bool) -> None:
    cfg = small_config(lora=lora)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, VOCAB, BATCH, "cpu", mode)
    with mode:
        fake = trace_step(model, optimizer, batch, StepSetup("cpu", None, cfg.optim.grad_clip))[0].peak
    ranks = run_distributed(_ddp_rank_peak, 2, copy.deepcopy(cfg), bucket_view)
    buckets = Allowances.for_run(target_device("cpu", None, None), fake.by_category, 0, 2,
                                 4.0 * ranks[0]["trainable"], bucket_view, RunOverheads.of(cfg, 2, {}))
    assert buckets.total > 0
    for rank in ranks:
        for measured in rank["peak"]:  # every steady step of every rank
            assert measured == pytest.approx(fake.peak + buckets.total, rel=0.02)


def _fsdp_rank_peak(rank: int, world_size: int, cfg: Config, grad_accum: int) -> list[int]:
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
    setup = StepSetup("cpu", dtype, cfg.optim.grad_clip, grad_accum)

    def build() -> Callable[[], object]:
        torch.manual_seed(0)
        model = with_run_loss(training_model(cfg.model, VOCAB), cfg)
        model.train()
        shard_model(model, cfg.parallel, torch.device("cpu"), cfg.train.precision)
        optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=1e-3,
                                      **impl_kwargs(cfg.optim.impl, torch.device("cpu")))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return lambda: trace_step(model, optimizer, {"input_ids": ids, "labels": ids}, setup)

    return steady_peak(build)


@pytest.mark.parametrize(("stage", "precision", "grad_accum"),
                         [(2, "bf16", 1), (3, "bf16", 1), (2, "fp32", 1), (3, "fp32", 1), (3, "bf16", 2)])
@pytest.mark.slow  # 2 ranks
def test_an_fsdp2_rank_peaks_as_the_sharded_single_rank_trace(stage: int, precision: str, grad_accum: int) -> None:
    cfg = small_config()
    cfg.model.num_layers, cfg.parallel.zero_stage, cfg.train.precision = 4, stage, precision
    cfg.model.vocab_size = cfg.data.vocab_size = VOCAB
    device = target_device("cpu", None, None)
    plan = build_plan(cfg, 2, None)
    working_copy = precision == "bf16"  # FSDP2 gathers bf16 parameters and computes on them
    traced = trace_peak(cfg, VOCAB, TracedStep(BATCH, ActivationCheckpointing.none, 4, grad_accum), device,
                        working_copy).peak
    predicted = sum(shard(traced.by_category, stage, 2, plan, grad_accum > 1).values())
    assert shard(traced.by_category, stage, 2, plan)["parameters"] == plan.memory[stage].params
    for rank in run_distributed(_fsdp_rank_peak, 2, copy.deepcopy(cfg), grad_accum):
        for measured in rank:  # every steady step of every rank
            assert measured == pytest.approx(predicted, rel=0.02)


def test_a_step_that_does_not_fit_the_device_is_flagged_and_only_options_that_fit_are_recommended(
    shared_traces: dict[str, Any],
) -> None:
    """``fits`` weighs the traced peak plus the allowances (the CUDA context, the allocator's share) against the
    device; an option is recommended only when both fit its usable memory (less auto's margin, as auto chooses).
    Devices whose usable memory is just too small for the configured step, and too small for any step (below the
    0.75 GiB CUDA context)."""
    traces = shared_traces
    cfg = small_config()
    cfg.data.global_batch_size = cfg.data.micro_batch_size = 1  # one micro batch size: fewer shapes to trace
    plan = build_plan(cfg, 1, "H100")

    def planned(memory_gib: float | None) -> MemoryPlan:
        return plan_memory(cfg, plan, VOCAB, target_device("h100", memory_gib, None), RunOverheads.of(cfg, 1, {}))

    roomy = planned(None)
    traced = len(traces)
    assert roomy.fits and roomy.to_json()["fits"] is True
    assert roomy.peak < 0.1 * roomy.total  # a tiny model: the allowances are most of what a rank needs
    for usable, some_fit in ((roomy.total - 1024, True), (0.5 * GiB, False)):  # just under the step; under any
        memory = usable / (1 - AUTO_MARGIN)
        tight = planned(memory / GiB)
        out = tight.to_json()
        assert out["usable_bytes_per_rank"] == pytest.approx(usable, abs=1)
        assert tight.peak < usable  # the traced peak alone would fit: the allowances are what does not
        assert all(o["total_bytes_per_rank"] <= usable for o in out["options"])
        assert not any(o["activation_checkpointing"] == "none" for o in out["options"])  # the configured step
        best = out["recommendation"]
        if not some_fit:
            assert best is None and out["options"] == []
        else:  # checkpointing fits where the configured step does not
            assert best is not None and best["activation_checkpointing"] in ("selective", "full")
            assert best["total_bytes_per_rank"] <= usable < out["total_bytes_per_rank"]
    tight = planned(0.5)  # the whole memory too small for the configured step: flagged
    assert not tight.fits and tight.to_json()["fits"] is False and tight.total > tight.device.memory_gib * GiB
    assert len(traces) == traced  # each shape traced once, not once per device


def test_fsdp2_stages_plan_no_parameter_copies_and_keep_every_category() -> None:
    """ZeRO-2/3 shard the single-rank trace into the same categories, with no fp16/bf16 parameter copies (FSDP2's
    gathered working copy is in its parameters); ZeRO-0/1 keep the traced copies."""
    cfg = small_config()
    plan = build_plan(cfg, 2, None)
    traced = {category: float(2**20) for category in CATEGORIES}
    for stage in range(4):
        out = shard(traced, stage, 2, plan)
        assert set(out) == set(CATEGORIES)
        assert out["parameter copies"] == (0.0 if stage >= 2 else 2**20)


def test_an_adapter_run_weighs_only_the_stages_that_train_adapters(shared_traces: dict[str, Any]) -> None:
    """LoRA trains its adapters under DDP or ZeRO-1 only (``models/finetune_rules.py`` refuses ZeRO-2/3): on 2
    ranks its options are stages 0 and 1 alone, none the run would refuse; a full fine-tune of the same model
    weighs all four."""
    stages = {}
    for lora in (True, False):
        cfg = small_config(lora=lora)
        cfg.data.global_batch_size, cfg.data.micro_batch_size = 2, 1
        plan = build_plan(cfg, 2, "H100")
        mp = plan_memory(cfg, plan, VOCAB, target_device("h100", None, None), RunOverheads.of(cfg, 2, {}))
        stages[lora] = {o.stage for o in mp.options}
    assert stages == {True: {0, 1}, False: {0, 1, 2, 3}}


def test_the_plan_says_when_eager_selective_checkpointing_makes_the_host_the_bound(
    shared_traces: dict[str, Any],
) -> None:
    """A tiny model on an H100 computes a block in microseconds, far less than eager selective checkpointing's
    host time per block (measured on CPU: host_cost.py): the plan says the host is the bound and names
    train.compile=true; compiled, or with a block that computes longer than that, it says nothing."""
    from ddptrain.plan.memory.host_cost import EAGER_HOST_S_PER_BLOCK, selective_host_bound
    from ddptrain.plan.memory.render import render_memory_plan

    cfg = small_config(checkpointing="selective")
    cfg.data.global_batch_size = cfg.data.micro_batch_size = 1
    plan = build_plan(cfg, 1, "H100")
    eager = plan_memory(cfg, plan, VOCAB, target_device("h100", None, None), RunOverheads.of(cfg, 1, {}))
    assert eager.host_note and "the host is the bound" in eager.host_note
    assert "train.compile=true" in eager.host_note and eager.to_json()["host_note"] == eager.host_note
    assert f"Host: {eager.host_note}." in " ".join(render_memory_plan(eager, 1).split())
    cfg.train.compile = True
    compiled = plan_memory(cfg, plan, VOCAB, target_device("h100", None, None), RunOverheads.of(cfg, 1, {}))
    assert compiled.host_note is None and "Host:" not in render_memory_plan(compiled, 1)
    # the LM head's line in each of its three wordings, and the caveat that the allowances are not traced
    both = {"chunked": 1 * 2**30, "full logits": 3 * 2**30}

    def worded(chunk_tokens: int | None, configured: bool) -> str:
        share = LogitsShare(chunk_tokens, both if chunk_tokens else {"full logits": both["full logits"]}, both)
        return " ".join(render_memory_plan(dataclasses.replace(compiled, logits=share,
                                                                configured_chunked=configured), 1).split())

    assert "LM head and loss at the peak (train.chunked_loss on, chunks of 16 tokens): " in worded(16, True)
    assert "LM head and loss at the peak (train.chunked_loss off): 1.00 GiB with chunked" in worded(16, False)
    not_exact = worded(None, True)
    assert "LM head and loss at the peak (train.chunked_loss off: not exact for this model's head): " in not_exact
    assert "The allowances are assumptions, not traced. ZeRO-1/2/3 figures shard" in not_exact
    # a recommendation with no predicted speedup (no step time to compare with) ends after its bytes and step
    unknown = dataclasses.replace(compiled, options=[dataclasses.replace(compiled.options[0], speedup=None)])
    line = next(ln for ln in render_memory_plan(unknown, 1).splitlines() if ln.startswith("Recommendation:"))
    assert re.fullmatch(r"Recommendation: micro batch 1 \(grad_accum 1\), checkpointing \w+, DDP: fits \([^)]*\)"
                        r"( \([\d.,]+ ms a step\))?\.", line), line
    host = EAGER_HOST_S_PER_BLOCK[ActivationCheckpointing.selective]
    assert selective_host_bound(ActivationCheckpointing.selective, False, 0.9 * host, 1) is not None
    assert selective_host_bound(ActivationCheckpointing.selective, False, 1.1 * host, 1) is None  # compute-bound
    assert selective_host_bound(ActivationCheckpointing.full, False, 0.9 * host, 1) is None


def test_dry_run_prints_the_traced_peak_and_writes_plan_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's own entry, in this process: the dry run starts no worker, so a fresh interpreter would only add
    its imports (the slow tier's CLI tests cover the command's process)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path))
    code = ddptrain_main(["launch.dry_run=true", "plan.device=t4", "plan.world_size=2", "data.seq_len=64",
                          "data.global_batch_size=16", "data.micro_batch_size=4", "train.loss_chunk_tokens=16",
                          f"hydra.run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Peak memory per rank on t4" in out and "Recommendation: micro batch" in out
    # the table's header: the categories at the peak, and what each holds per rank
    assert any("at the peak" in line and "per rank" in line and "Peak memory" not in line
               for line in out.splitlines())
    assert "DDP gradient buckets" in out and "Precision: fp16 compute, loss-scaled" in out
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["device"] == "t4" and plan["compute_dtype"] == "float16"  # what train.precision=auto runs on a T4
    # the step was traced under fp16 autocast: its parameters' fp16 copies are held for backward
    assert plan["by_category"]["parameter copies"] > 0
    assert plan["peak_bytes_per_rank"] == sum(plan["by_category"].values()) > 0
    assert set(plan["by_category"]) == set(CATEGORIES)
    # the printed table holds plan.json's figures: a row per category with its bytes, and the total with its verdict
    rows = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    for category, nbytes in plan["by_category"].items():
        assert f"{category} {nbytes / 2**30:,.2f} GiB" in rows, category
    assert any(r.startswith(f"total {plan['total_bytes_per_rank'] / 2**30:,.2f} GiB: fits in ") for r in rows)
    best = plan["recommendation"]
    assert best["micro_batch_size"] * best["grad_accum"] * 2 == 16
    # a tiny model on a T4: the step and the recommendation, allowances included, fit its memory
    assert plan["fits"] is True and plan["total_bytes_per_rank"] <= plan["device_memory_bytes"]
    assert best["total_bytes_per_rank"] <= plan["device_memory_bytes"]
    assert plan["fit_gap"] is None  # every figure a full trace: no fit of small traces stood in for one
    # the LM head and loss chunk by chunk (on by default): their share with chunking on and off
    share = plan["logits_and_loss"]
    assert plan["chunked_loss"] and share["chunk_tokens"] == 16  # a number only where the two traces differ
    # 0 here: this step peaks outside the chunk loop (a chunk's fp16 head gradient makes no [vocab, hidden]
    # temporaries, whose ~6 MB per chunk put the peak inside it)
    assert 0 <= share["chunked"]["logits_and_loss_bytes"] < share["full logits"]["logits_and_loss_bytes"] / 4
    assert share["chunked"]["peak_bytes_per_rank"] == plan["peak_bytes_per_rank"]
    assert share["full logits"]["peak_bytes_per_rank"] > plan["peak_bytes_per_rank"]
    assert "LM head and loss at the peak (train.chunked_loss on, chunks of 16 tokens)" in out
    # the activations in each checkpointing mode at the configured micro batch (none is configured)
    modes = plan["by_checkpointing"]
    assert plan["activation_checkpointing"] == "none" and set(modes) == {"none", "selective", "full"}
    activations = [modes[mode]["activations_bytes"] for mode in ("none", "selective", "full")]
    assert activations == sorted(activations, reverse=True) and len(set(activations)) == 3 and activations[2] > 0
    assert modes["none"]["peak_bytes_per_rank"] == pytest.approx(plan["peak_bytes_per_rank"], rel=0.02)
    assert "Activations by model.activation_checkpointing" in out


def step_times(bandwidth_gbps: float, latency_us: float, grad_accum: int) -> dict[int, float]:
    """The recommendation's predicted step per ZeRO stage for a 2-block model on 8 H100s, micro batch 2."""
    cfg = small_config()
    cfg.plan.bandwidth_gbps, cfg.plan.latency_us = bandwidth_gbps, latency_us
    cfg.data.global_batch_size, cfg.data.micro_batch_size = 16 * grad_accum, 2
    plan = build_plan(cfg, 8, "H100")
    device = target_device("h100", None, None)
    none = ActivationCheckpointing.none
    return {stage: predicted_step_s(plan, device, stage, none, 2, grad_accum, 8) for stage in range(4)}


def test_the_step_time_ranking_charges_each_zero_stage_its_own_communication() -> None:
    instant = step_times(1e9, 0.0, 4)  # a free link: compute only, the same for every stage
    assert all(t == pytest.approx(instant[0], rel=1e-6) for t in instant.values())
    slow = step_times(0.01, 10.0, 1)  # 10 MB/s: communication dominates
    # ZeRO-1 adds its updated shards' exchange after the update (nothing hides it); ZeRO-2 gathers bf16
    # parameters where DDP all-reduces fp32 gradients twice over (fewer bytes); ZeRO-3 gathers twice
    assert slow[2] < slow[0] < slow[1] and slow[2] < slow[3]
    accumulating = step_times(0.01, 10.0, 4)
    # FSDP2 gathers in every micro batch and reduce-scatters once; DDP all-reduces once per step
    assert accumulating[0] < accumulating[2] < accumulating[3]
    exposed = {s: accumulating[s] - instant[s] for s in range(4)}
    assert exposed[0] == pytest.approx(slow[0] - step_times(1e9, 0.0, 1)[0], rel=0.01)
    assert exposed[3] - exposed[2] == pytest.approx(4 * (slow[3] - slow[2]), rel=0.01)


# With checkpointing, the 4-bit step peaks inside the recomputed forward's matmul of a dequantized weight, where
# the CPU's bf16 matmul holds a scratch buffer of its own (about 98 KiB here) that no op returns, so no tracker
# sees it: a micro batch of 8 keeps that fixed buffer under 2% of this tiny model's peak (2.3% at 4).
NF4_BATCH = 8


def nf4_config(base: Path, checkpointing: str) -> Config:
    """``model.*`` describing the tiny saved Llama at ``base``, loaded in 4-bit NF4 under LoRA."""
    cfg = Config()
    m = cfg.model
    m.arch, m.hidden_size, m.intermediate_size = "llama", TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    m.num_layers, m.num_heads = TINY_LLAMA["num_hidden_layers"], TINY_LLAMA["num_attention_heads"]
    m.num_kv_heads, m.max_position_embeddings = TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["max_position_embeddings"]
    m.tie_embeddings = False  # LlamaConfig's default, as saved
    m.pretrained, m.quantize, m.lora.enabled = str(base), "nf4", True
    m.activation_checkpointing = ActivationCheckpointing(checkpointing)
    cfg.data.seq_len = SEQ
    return cfg


def real_qlora_state(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The model as a QLoRA run loads and prepares it (bitsandbytes' 4-bit load on the CPU), AdamW with state."""
    torch.manual_seed(0)
    vocab = TINY_LLAMA["vocab_size"]
    model = with_run_loss(prepare_for_finetuning(build_model(cfg.model, vocab), cfg.model), cfg)
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=1e-3,
                                  **impl_kwargs(cfg.optim.impl, torch.device("cpu")))
    create_optimizer_state(optimizer, model.parameters())
    ids = torch.randint(0, vocab, (NF4_BATCH, SEQ))
    return model, optimizer, {"input_ids": ids, "labels": ids}


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def test_an_nf4_base_is_traced_as_packed_4bit_weights_with_their_quantization_state(pretrained_base: Path) -> None:
    import bitsandbytes as bnb

    cfg = nf4_config(pretrained_base, "none")
    model, optimizer, _ = fake_training_state(cfg, TINY_LLAMA["vocab_size"], NF4_BATCH, "cpu",
                                              FakeTensorMode(allow_non_fake_inputs=True))
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 7 * TINY_LLAMA["num_hidden_layers"]  # every projection of every block; not lm_head
    for layer in layers:  # two weights per byte, block scales 8-bit (double quantization) in blocks of 64
        assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == layer.in_features * layer.out_features // 2
        state = layer.weight.quant_state
        assert state.blocksize == 64 and state.absmax.dtype == torch.uint8 and state.state2.blocksize == 256
    real_model, real_optimizer, _ = real_qlora_state(cfg)
    # the model state the trace starts from is the loaded model's, to the byte: packed weights, quantization
    # state, the fp32 embeddings, norms and head of k-bit preparation, the adapters
    fake_params = storage_bytes(model_state_tensors(model, optimizer)[0])
    assert fake_params == storage_bytes(model_state_tensors(real_model, real_optimizer)[0])
    packed = sum(layer.in_features * layer.out_features // 2 for layer in layers)
    assert storage_bytes([layer.weight for layer in layers]) == packed


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(None, marks=pytest.mark.slow)], ids=["bf16", "fp32"])
def test_a_traced_qlora_step_peaks_like_the_real_4bit_cpu_step_in_every_category(
    pretrained_base: Path, checkpointing: str, dtype: torch.dtype | None
) -> None:
    cfg = nf4_config(pretrained_base, checkpointing)
    setup = StepSetup("cpu", dtype, cfg.optim.grad_clip)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, optimizer, batch = fake_training_state(cfg, TINY_LLAMA["vocab_size"], NF4_BATCH, "cpu", mode)
    with mode:
        fake = trace_step(model, optimizer, batch, setup)[0].peak
    real_model, real_optimizer, real_batch = real_qlora_state(cfg)
    real = trace_step(real_model, real_optimizer, real_batch, setup)[0].peak
    measured = allocator_peak(real_model, real_optimizer, real_batch, setup)
    assert fake == real  # the same step on fake and on real tensors: every category to the byte
    assert fake.peak == pytest.approx(measured, rel=0.02)
    # with the chunked loss (on by default) no [tokens, vocab] gradient is made in backward: the peak can fall
    # where the forward's activations are all live and backward has made nothing yet
    assert fake.by_category["activations"] + fake.by_category["temporaries"] > 0 and fake.by_category["optimizer"] > 0


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_traced_4bit_matmul_holds_the_dequantized_weight_as_bitsandbytes_kernel_does(device_type: str) -> None:
    import bitsandbytes as bnb

    from ddptrain.telemetry.nf4_kernels import kernel_compositions

    out_features, in_features, rows = 256, 128, 32
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed, state = bnb.functional.quantize_4bit(weight, compress_statistics=True, quant_type="nf4")
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    expected = bnb.matmul_4bit(x, packed, quant_state=state)  # bitsandbytes' own CPU kernel
    tracker = PeakTracker(kernel_compositions(device_type))
    with tracker:
        tracker.mark([x, packed, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code],
                     "parameters")
        out = bnb.matmul_4bit(x, packed, quant_state=state)
    assert torch.equal(out, expected)  # the same computation, op by op
    scales = 4 * in_features * out_features // 64  # fp32 block scales, dequantized once more with the offset
    held = 2 * scales if device_type == "cuda" else scales  # CUDA's fallback keeps both until it returns
    # at the peak: the weight dequantized to bf16, the scales, the output
    assert tracker.peak.by_category["activations"] == 2 * in_features * out_features + held + 2 * rows * out_features
