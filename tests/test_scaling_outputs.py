"""scripts/scaling.py's outputs: where the table, CSV and plot go and the line that names them (the sweep itself,
with real runs: tests/test_scaling.py, slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


def _scaling() -> Any:
    path = Path(__file__).parents[1] / "scripts" / "scaling.py"
    spec = importlib.util.spec_from_file_location("scaling_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_out_the_files_go_beside_the_runs_and_the_last_line_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The files went into the current directory (``--out .``) under a line of bare names; now they go to the
    runs' directory and the line gives their full paths."""
    scaling = _scaling()

    def run_one(size: int, batch: int, run_dir: Path, overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
        return {"model": "llama_tiny", "global_batch_size": batch, "grad_accum": 1, "tokens_per_s": 1000.0 * size}

    monkeypatch.setattr(scaling, "run_one", run_one)
    monkeypatch.chdir(tmp_path)
    assert scaling.main(["--sizes", "1", "2", "--runs", "sweep"]) == 0
    runs = tmp_path / "sweep"
    written = [runs / name for name in ("scaling.md", "scaling.csv", "scaling.png")]
    assert all(path.is_file() for path in written)
    assert not list(tmp_path.glob("scaling.*"))  # nothing in the directory it was started from
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"scaling: wrote {written[0]}, {written[1]} and {written[2]}"
