"""The step timeline: drawn from a real 2-rank gloo DDP trace with sane figures; exact on hand-made traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.telemetry.timeline import read_step, render_timeline
from tests.helpers.dist import run_distributed
from tests.helpers.in_process import train_here


def profile_ddp_steps(rank: int, world_size: int, trace_path: str) -> None:
    """Train a small MLP under DDP and torch.profiler (2 warm steps, 2 recorded); rank 0 exports the trace."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets: comm starts during backward
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(4):
            ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    if rank == 0:
        prof.export_chrome_trace(trace_path)


def test_real_gloo_trace_draws_a_step_with_sane_figures(tmp_path: Path) -> None:
    trace = tmp_path / "trace_rank0.json"
    run_distributed(profile_ddp_steps, 2, str(trace))
    png = tmp_path / "timeline.png"
    figures = render_timeline(trace, png)
    assert png.stat().st_size > 10_000
    assert figures["step"] == 3  # the last recorded step
    assert figures["compute_s"] > 0 and figures["comm_s"] > 0 and figures["backward_s"] > 0
    assert figures["overlap_s"] <= min(figures["compute_s"], figures["comm_s"]) + 1e-9
    for key in ("compute_s", "comm_s", "overlap_s", "exposed_comm_s", "forward_s", "optimizer_s"):
        assert 0 <= figures[key] <= figures["step_s"], (key, figures)
    assert render_timeline(trace, tmp_path / "step2.png", step=2)["step"] == 2


def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args: object) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_cpu_trace_figures_are_exact() -> None:
    """Step of 100 µs: forward 0-20, backward 20-60 (two ops; an all-reduce launched inside), optimizer 80-100;
    gloo's thread runs the all-reduce 40-80, so 20 µs of it hide behind backward and 20 µs are exposed."""
    trace = {"traceEvents": [
        op("ProfilerStep#7", 0, 100, cat="user_annotation"),
        op("DistributedDataParallel.forward", 0, 20, cat="user_annotation"),
        op("aten::mm", 5, 10),  # nested in forward: not counted twice
        op("autograd::engine::evaluate_function: MmBackward0", 20, 18),
        op("autograd::engine::evaluate_function: AccumulateGrad", 40, 20),  # the 2 µs gap: the autograd engine
        op("c10d::allreduce_", 40, 1),  # the launch, nested in backward: compute, not communication
        op("gloo:all_reduce", 40, 40, tid=2, cat="user_annotation"),
        op("Optimizer.step#AdamW.step", 80, 20, cat="user_annotation"),
        op("gloo:all_reduce", 150, 10, tid=2, cat="user_annotation"),  # another step's
    ]}
    figures = read_step(trace).figures()
    expected = {"step": 7, "step_s": 100e-6, "compute_s": 80e-6, "comm_s": 40e-6, "overlap_s": 20e-6,
                "exposed_comm_s": 20e-6, "overlap_pct": 50.0, "forward_s": 20e-6, "backward_s": 40e-6,
                "optimizer_s": 20e-6, "other_s": 0.0}
    assert figures == pytest.approx(expected)


def test_cuda_trace_counts_kernels_of_the_step_by_launch() -> None:
    """On CUDA the lanes are kernels, launched from any thread of the process: forward from the training thread (1),
    backward from the autograd engine's device thread (2), and NCCL through the driver (``cuLaunchKernelEx``). A
    forward kernel 20-30, a backward kernel 30-70 and an NCCL kernel 50-90 (20 µs of it hidden); a kernel launched
    in the next step does not belong to this one."""
    trace = {"traceEvents": [
        op("ProfilerStep#3", 0, 60, cat="user_annotation"),
        op("aten::linear", 1, 3),
        op("cudaLaunchKernel", 2, 1, cat="cuda_runtime", correlation=4),
        op("autograd::engine::evaluate_function: MmBackward0", 4, 40, tid=2),
        op("cudaLaunchKernel", 5, 2, tid=2, cat="cuda_runtime", correlation=1),
        op("cuLaunchKernelEx", 10, 2, tid=2, cat="cuda_driver", correlation=2),
        op("cudaLaunchKernel", 70, 2, cat="cuda_runtime", correlation=3),
        {**op("sm80_xmma_gemm", 20, 10, tid=7, cat="kernel", correlation=4), "pid": 0},
        {**op("sm80_xmma_gemm", 30, 40, tid=7, cat="kernel", correlation=1), "pid": 0},
        {**op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 40, tid=13, cat="kernel", correlation=2), "pid": 0},
        {**op("sm80_xmma_gemm", 95, 5, tid=7, cat="kernel", correlation=3), "pid": 0},
    ]}
    timeline = read_step(trace)
    figures = timeline.figures()
    assert figures["step_s"] == pytest.approx(90e-6)  # the step's kernels end after its CPU range
    assert figures["compute_s"] == pytest.approx(50e-6) and figures["backward_s"] == pytest.approx(40e-6)
    assert figures["forward_s"] == pytest.approx(10e-6)
    assert figures["comm_s"] == pytest.approx(40e-6) and figures["overlap_s"] == pytest.approx(20e-6)
    assert list(timeline.comm) == ["stream 13"]


READS_THEN_DRAWS = """
import json, sys
from pathlib import Path
from ddptrain.telemetry.timeline import read_step, render_timeline
trace, png = Path(sys.argv[1]), Path(sys.argv[2])
read_step(json.loads(trace.read_text())).figures()
read = "matplotlib" in sys.modules
render_timeline(trace, png)
print("MATPLOTLIB", json.dumps([read, "matplotlib" in sys.modules]))
"""


def test_reading_a_trace_imports_no_matplotlib_and_drawing_it_does(tmp_path: Path) -> None:
    """matplotlib (about 0.6 CPU s to import) is imported by ``draw`` alone: a fresh interpreter that imports
    the timeline module and reads a step's figures has not loaded it; once it draws the step, it has (the probe
    sees the import when there is one)."""
    trace, png = tmp_path / "trace.json", tmp_path / "t.png"
    trace.write_text(json.dumps({"traceEvents": [
        op("ProfilerStep#1", 0, 100, cat="user_annotation"), op("aten::mm", 5, 10),
        op("gloo:all_reduce", 40, 40, tid=2, cat="user_annotation")]}))
    done = subprocess.run([sys.executable, "-c", READS_THEN_DRAWS, str(trace), str(png)], capture_output=True,
                          text=True, timeout=120, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("MATPLOTLIB ")), None)
    assert line is not None, done.stderr[-2000:]
    assert json.loads(line.removeprefix("MATPLOTLIB ")) == [False, True]
    assert png.stat().st_size > 0


def test_a_trace_without_profiler_steps_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [op("aten::mm", 0, 1)]}))
    with pytest.raises(ValueError, match="ProfilerStep"):
        render_timeline(trace, tmp_path / "t.png")


PROFILED = {"train": {"steps": 3, "log_every": 3}, "profile": {"enabled": True, "wait": 0, "warmup": 1, "active": 1}}


def test_a_profiled_run_in_this_process_writes_its_trace_and_draws_its_timeline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """profile.enabled=true on one rank in the test process: step 2 is recorded, its Chrome trace written and the
    timeline drawn from it when the run ends."""
    ran = train_here(tmp_path, monkeypatch, PROFILED)
    assert ran.error is None
    assert json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_a_profiled_run_that_fails_keeps_its_trace_and_draws_no_timeline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run aborted by a non-finite loss at step 3, after the recorded step: the trace stays, and no
    timeline is drawn on the way out of a failing run."""
    ran = train_here(tmp_path, monkeypatch, PROFILED, fault="nan@step:3:0")
    assert ran.exit_code == 3 and ran.error is not None
    assert (tmp_path / "trace_rank0.json").is_file()
    assert not (tmp_path / "timeline.png").exists()
