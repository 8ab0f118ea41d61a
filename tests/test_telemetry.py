"""Scaling telemetry through the real loop: breakdown, exposed communication, overlap, MFU, efficiency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.config.schema import MetricsConfig
from ddptrain.data import BatchShape
from ddptrain.data.loader import TokenCount
from ddptrain.errors import ConfigError
from ddptrain.telemetry.baseline import load_baseline
from ddptrain.telemetry.comm import SyncSample, sync_metrics
from ddptrain.telemetry.metrics import StepMetrics, TokenFlops
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each, without_the_planned_peak
from tests.helpers.trainers import train_each_with

BREAKDOWN = ("time_data_s", "time_forward_sync_s", "time_forward_s", "time_backward_s", "time_exposed_comm_s",
             "time_optimizer_s")


BASE = {
    "model": {"hidden_size": 32, "num_layers": 8, "num_heads": 2, "num_kv_heads": 2},  # many small tensors
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 512, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 4},
    "train": {"steps": 10, "log_every": 2, "eval_every": 0},
}


def test_tokens_seen_counts_a_step_kept_out_of_its_window(tmp_path: Path) -> None:
    """With train.log_every=3, step 2 (the CPU memory tracker's, slower than a plain step) is kept out of the first
    window's throughput; its tokens and step 1's still count in tokens_seen, summed over both ranks."""
    variant = {"model": {"num_layers": 2}, "train": {"steps": 4, "log_every": 3}}
    (run,) = run_distributed(train_each, 2, str(tmp_path), BASE, [variant])[0]
    per_step = 8 * 32  # global batch x seq_len: fixed blocks, every position a real token
    metrics = run["metrics"]
    assert [m["step"] for m in metrics] == [3, 4]
    assert [m["tokens_seen"] for m in metrics] == [3 * per_step, 4 * per_step]
    # the first window timed step 3 alone: steps 1 and 2 were left out of it
    assert metrics[0]["tokens_per_s"] * metrics[0]["step_time_s"] == pytest.approx(per_step)


def test_metrics_are_present_and_sane_with_a_single_rank_baseline(tmp_path: Path) -> None:
    (single,) = run_distributed(train_each, 1, str(tmp_path), BASE, [{}])[0]
    baseline = single["summary"]["tokens_per_s_per_rank"]
    assert baseline > 0
    variants = [
        {"parallel": {"bucket_cap_mb": 0.05}, "metrics": {"baseline": single["dir"]}},
        {"metrics": {"peak_tflops": 1.0}},
    ]
    ddp, with_peak = run_distributed(train_each, 2, str(tmp_path), BASE, variants)[0]
    for m in ddp["metrics"]:
        for key in (*BREAKDOWN, "time_step_s", "tokens_per_s", "tokens_per_s_per_rank", "tflops_per_rank",
                    "comm_bytes", "comm_time_s", "overlap_pct", "algbw_gbps", "busbw_gbps", "rss_gib",
                    "scaling_efficiency"):
            assert key in m, key
        parts = sum(m[k] for k in BREAKDOWN)
        assert parts == pytest.approx(m["time_step_s"], rel=0.10), {k: m[k] for k in (*BREAKDOWN, "time_step_s")}
        assert 0.0 <= m["overlap_pct"] <= 100.0
        # against the 1-rank run's tokens/s per rank (metrics.baseline=its run dir): the formula, not a bound that
        # two runs timed at different moments of a busy machine could cross
        assert m["scaling_efficiency"] == pytest.approx(m["tokens_per_s"] / (2 * baseline)), (m, baseline)
        assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"])  # 2(N-1)/N = 1 at N = 2
        assert "mfu_pct" not in m  # CPU: no known peak, no MFU
        assert m["padding_pct"] == 0.0  # fixed-length blocks: every computed position is a real token
    assert all(0 < m["mfu_pct"] <= 100 for m in with_peak["metrics"])
    summary = ddp["summary"]
    assert summary["predicted"]["comm_payload_bytes"] == summary["comm_bytes"]  # fp32 all-reduce of 4Ψ bytes


def test_naive_engine_exposes_more_communication_than_bucketed(tmp_path: Path) -> None:
    variants = [{"parallel": {"engine": "naive"}}, {"parallel": {"engine": "bucketed", "bucket_cap_mb": 0.02}}]
    naive, bucketed = (r["summary"] for r in run_distributed(train_each, 2, str(tmp_path), BASE, variants)[0])
    # naive all-reduces ~70 tensors one by one after backward; bucketed launches each bucket as it fills.
    assert naive["time_exposed_comm_s"] > 1.5 * bucketed["time_exposed_comm_s"], (naive, bucketed)
    assert naive["overlap_pct"] < bucketed["overlap_pct"]


def test_sync_metrics_follow_nccl_tests_definitions() -> None:
    out = sync_metrics([SyncSample(8e9, 2.0, 0.5), SyncSample(8e9, 2.0, 1.5)], world_size=4)
    assert out["comm_bytes"] == 8e9 and out["comm_time_s"] == 2.0
    assert out["overlap_pct"] == pytest.approx(50.0)
    assert out["algbw_gbps"] == pytest.approx(4.0) and out["busbw_gbps"] == pytest.approx(6.0)


def test_baseline_is_a_number_or_a_run_dir(tmp_path: Path) -> None:
    assert load_baseline("1234.5") == 1234.5
    (tmp_path / "summary.json").write_text(json.dumps({"tokens_per_s_per_rank": 99.0}))
    assert load_baseline(str(tmp_path)) == 99.0
    with pytest.raises(ConfigError, match=r"metrics\.baseline="):
        load_baseline(str(tmp_path / "nope"))


SAVE_S = 1000.0  # a save's seconds on the windows' clock: a window that kept one could not pass in the test's time
SLEEP_S = 0.05  # ... and its real seconds, which goodput books (a lower bound: a busy machine only adds to it)


def _slow_saves() -> type:
    """A trainer whose every checkpoint save takes ``SAVE_S`` on the windows' clock (as a large model's save does,
    without the wait) and ``SLEEP_S`` of real time."""
    import time

    from ddptrain.train.trainer import Trainer

    class SlowSaves(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            ahead, clock, save = [0.0], self.metrics.clock, self.checkpoints.maybe_save
            self.metrics.clock = lambda: clock() + ahead[0]

            def slow_save(step: int, **kwargs: bool) -> bool:
                saved = save(step, **kwargs)
                if saved:
                    ahead[0] += SAVE_S
                    time.sleep(SLEEP_S)
                return saved

            self.checkpoints.maybe_save = slow_save  # type: ignore[method-assign]  # this trainer's only

    return SlowSaves


def _train_with_slow_saves(rank: int, world_size: int, tmp: str, base: dict, variants: list) -> list[dict]:
    """``train_each`` through the slow-saving trainer (``_slow_saves``), without the summary's traced memory plan
    (as ``train_each``: about a third of these runs' CPU, read by no check here)."""
    without_the_planned_peak()
    return train_each_with(_slow_saves(), rank, world_size, tmp, base, variants)


def _stop_with_slow_saves(rank: int, world_size: int, tmp: str, base: dict,
                          variants: list[tuple[dict, int]]) -> list[dict]:
    """Each ``(variant, step)``: the slow-saving trainer asked to stop within ``step`` (as SIGTERM's handler asks,
    before the step's check); per run the message it stopped with and metrics.jsonl's records."""
    import signal

    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.step.compute import Stepped
    from ddptrain.step.control import Stopped
    from tests.helpers.runs import make_config

    without_the_planned_peak()  # as train_each: no check here reads the summary's traced memory plan

    class StopsWithin(_slow_saves()):  # type: ignore[misc]
        stop_at = 0

        def train_step(self, step: int, check: bool) -> Stepped:
            if step == self.stop_at:
                self.stop.signum = signal.SIGTERM
            return super().train_step(step, check)

    results = []
    for i, (variant, stop_at) in enumerate(variants):
        StopsWithin.stop_at = stop_at
        run_dir = Path(tmp) / f"stop{i}"
        run_dir.mkdir(parents=True)
        env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
        try:
            StopsWithin(make_config(tmp, base, variant), env, torch.device("cpu"), run_dir, {}).train()
            message = None
        except Stopped as exc:
            message = str(exc).split(";")[0]
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        results.append({"message": message, "metrics": [json.loads(line) for line in lines]})
    return results


def test_a_windows_step_time_and_throughput_leave_out_every_one_of_its_checkpoint_saves(tmp_path: Path) -> None:
    """A save is not training time: the window's step time and tokens/s leave out every save in it (here one each
    step, the logging steps' too), as goodput books them apart, and none of an earlier window's. Before, the final
    save slowed the last window (an H100 run of llama_1b reported 4x its tokens/s in the steady windows, 1/20 in
    the last) and the summary's medians. Each save takes ``SAVE_S`` on the windows' clock: one save kept in a window
    of 2 steps would add ``SAVE_S / 2`` to its step time, one taken off twice would make it negative."""
    variant = {"train": {"steps": 6, "log_every": 2, "eval_every": 0}, "checkpoint": {"every_n_steps": 1}}
    # a window restarted within (step 2, the CPU memory tracker's, is left out of it): step 1's save goes with it
    restarted = {"train": {"steps": 3, "log_every": 3, "eval_every": 0}, "checkpoint": {"every_n_steps": 1}}
    two_layers = {**BASE, "model": {**BASE["model"], "num_layers": 2}}  # the windows' arithmetic needs no more
    run, tracked = run_distributed(_train_with_slow_saves, 1, str(tmp_path), two_layers, [variant, restarted])[0]
    windows = run["metrics"]
    assert [m["step"] for m in windows] == [2, 4, 6] and [m["step"] for m in tracked["metrics"]] == [3]
    assert run["summary"]["goodput"]["checkpoint_s"] >= 6 * SLEEP_S  # every save was booked there
    for m in windows + tracked["metrics"]:
        assert 0 < m["step_time_s"] < SAVE_S / 4, windows
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(8 * 32)  # a step's tokens


def test_a_stop_logs_its_step_once_without_its_save(tmp_path: Path) -> None:
    """A stop saves a checkpoint, which its step's line leaves out as it does any save's (each takes ``SAVE_S`` on
    the windows' clock): at a check step that is no logging step (3, train.check_every=3) and at a logging step
    (2, train.log_every=2), whose line is written once."""
    base = {**BASE, "model": {**BASE["model"], "num_layers": 2}, "checkpoint": {"every_n_steps": 0}}
    variants = [({"train": {"steps": 6, "log_every": 4, "check_every": 3}}, 3),
                ({"train": {"steps": 6, "log_every": 2, "check_every": 10}}, 2)]
    off_period, logging_step = run_distributed(_stop_with_slow_saves, 1, str(tmp_path), base, variants)[0]
    for run, step in ((off_period, 3), (logging_step, 2)):
        assert run["message"] == f"stopped by SIGTERM after step {step}", run
        assert [m["step"] for m in run["metrics"]] == [step], run
        (line,) = run["metrics"]
        assert 0 < line["step_time_s"] < SAVE_S / 4, line


def test_every_save_in_a_window_is_left_out_once_on_an_injected_clock() -> None:
    """The window's arithmetic, exactly: steps of 0.25 s, a save after each (of a different length every time),
    a window every 3 steps and time between windows (logging): each window's step time is 0.25 s."""
    now, count = [0.0], TokenCount()
    meter = StepMetrics(BatchShape.derive(4, 4, 1, 1, 8), torch.device("cpu"), TokenFlops(1.0), MetricsConfig(),
                        count, clock=lambda: now[0])
    windows = []
    for step in range(1, 10):
        meter.start_step(step)
        count.count({"input_ids": torch.zeros(4, 8, dtype=torch.long)})
        now[0] += 0.25
        meter.end_step(None, None)
        with meter.excluded():
            now[0] += 10.0 * step
        if step % 3 == 0:
            windows.append(meter.window(step, 0.0, 0.0, 0.0))
            now[0] += 5.0
            meter.restart_window()
    assert [(m["step_time_s"], m["tokens_per_s"]) for m in windows] == [(0.25, 4 * 8 / 0.25)] * 3


def test_the_windows_default_clock_is_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a clock of its own, a window is timed by ``device_clock`` of the meter's device (on CUDA: once the
    queued steps are done, not when they were queued)."""
    from ddptrain.telemetry import metrics

    now, asked, count = [0.0], [], TokenCount()
    monkeypatch.setattr(metrics, "device_clock", lambda device: asked.append(device) or now[0])
    meter = StepMetrics(BatchShape.derive(4, 4, 1, 1, 8), torch.device("cpu"), TokenFlops(1.0), MetricsConfig(),
                        count)
    meter.start_step(1)
    count.count({"input_ids": torch.zeros(4, 8, dtype=torch.long)})
    now[0] += 100.0
    meter.end_step(None, None)
    assert meter.window(1, 0.0, 0.0, 0.0)["step_time_s"] == 100.0
    assert set(asked) == {torch.device("cpu")}
