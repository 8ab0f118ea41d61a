"""The GPU benchmark's CPU-checkable logic: syncs counted per step, the table, the block it writes."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from ddptrain.telemetry.metrics import StepMetrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(StepMetrics, "start_step", StepMetrics.start_step)  # restored after the test
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    module.modes = modes
    return module


def test_sync_warnings_are_counted_against_the_step_they_happen_in(bench: ModuleType) -> None:
    meter = SimpleNamespace(timer=SimpleNamespace(start_step=lambda step: None))
    with bench.SyncCounter() as syncs:
        for step, n in [(1, 2), (2, 0), (3, 1)]:
            StepMetrics.start_step(meter, step)  # type: ignore[arg-type]
            for _ in range(n):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert syncs.per_step == {0: 0, 1: 2, 2: 0, 3: 1}
    assert bench.modes == ["warn", "default"]


def test_the_table_replaces_only_the_marked_block(bench: ModuleType, tmp_path: Path) -> None:
    summary = {"tokens_per_s": 123456.0, "mfu_pct": 47.5, "step_time_s": 0.25, "compile_s": 31.0}
    results = {("llama_1b", True): {"summary": summary, "steady_syncs": 0, "steady_steps": 28, "check_syncs": 1}}
    block = bench.table(results, "NVIDIA H100 80GB HBM3", SimpleNamespace(steps=40, window=10))
    assert "| llama_1b | compiled | 123,456 | 47.5% | 250 | 31 | 0 (of 28 steps) | 1 |" in block
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"before\n{bench.MARK_BEGIN}\nold\n{bench.MARK_END}\nafter\n")
    bench.write(doc, block)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{bench.MARK_END}\nafter\n")
    assert "old" not in text and block in text
