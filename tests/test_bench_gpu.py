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


def _steps(syncs_per_step: list[tuple[int, int]], other_warnings: int = 0) -> None:
    """Start each step through the metrics class, as the loop does, and raise its synchronizing warnings."""
    meter = SimpleNamespace(timer=SimpleNamespace(start_step=lambda step: None))
    for step, n in syncs_per_step:
        StepMetrics.start_step(meter, step)  # type: ignore[arg-type]
        for _ in range(n):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        for i in range(other_warnings):
            warnings.warn(f"some library's deprecation {i}", FutureWarning, stacklevel=1)


def test_only_synchronizing_operations_count_against_the_step_they_happen_in(bench: ModuleType) -> None:
    with pytest.warns(FutureWarning, match="some library's deprecation"), bench.SyncCounter() as syncs:
        _steps([(1, 2), (2, 0), (3, 1)], other_warnings=2)
    assert syncs.per_step == {0: 0, 1: 2, 2: 0, 3: 1}
    assert bench.modes == ["warn", "default"]


def test_each_run_counts_its_own_steps_and_restores_the_metrics_class(bench: ModuleType) -> None:
    original = StepMetrics.start_step
    with bench.SyncCounter() as first:
        _steps([(1, 1), (2, 3)])
    assert StepMetrics.start_step is original
    with bench.SyncCounter() as second:
        _steps([(1, 4)])
    assert StepMetrics.start_step is original
    assert first.per_step == {0: 0, 1: 1, 2: 3}, "the first run's counter went on counting the second run"
    assert second.per_step == {0: 0, 1: 4}


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


def test_the_chunked_head_benchmark_runs_on_the_cpu_and_its_variants_compute_the_same_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``scripts/bench_chunked_head.py --smoke``: every chunk size against full logits, both heads, one table."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # it imports its timing from bench_kernels, as a script does
    spec = importlib.util.spec_from_file_location("bench_chunked_head", ROOT / "scripts" / "bench_chunked_head.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--smoke", "--chunks", "16", "64"])
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| trainable") or
            line.startswith("| frozen")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (head, variant) for head in ("trainable", "frozen") for variant in ("full logits", "chunk 16", "chunk 64")]
    assert all(float(r[6]) < 1e-5 for r in rows)  # the loss: chunks sum the same terms as the full logits
    assert all(float(r[7]) < 2e-2 for r in rows)  # the gradients, within bf16's rounding of the full logits'
