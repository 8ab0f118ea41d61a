"""The metrics processor: turns a logging window of steps into the figures we log and summarise.

Throughput (tokens/s global and per rank), achieved TFLOP/s and MFU, the step breakdown, gradient-sync
bytes / time / exposure / overlap / bus bandwidth, memory, and scaling efficiency against a baseline.

Throughput counts real tokens only: the micro batches' own count of non-padding tokens, summed over ranks at each
window, never ``seq_len`` per sequence. ``padding_pct`` is the share of computed positions that were padding.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.config.schema import MetricsConfig
from ddptrain.data import BatchShape
from ddptrain.data.loader import TokenCount
from ddptrain.telemetry.baseline import load_baseline
from ddptrain.telemetry.comm import SyncSample, sync_metrics
from ddptrain.telemetry.memory import device_memory
from ddptrain.telemetry.peak import mfu, peak_tflops
from ddptrain.telemetry.timers import StepTimer, device_clock


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs per token at ``data.seq_len`` tokens per sequence (``per_token``, whose attention term is
    12·L·H·Q·T), and attention's FLOPs per pair of tokens it relates (``attention``, 12·L·H·Q), which corrects
    the count for sequences shorter than ``seq_len``."""

    per_token: float
    attention: float = 0.0


class StepMetrics:
    """Collects each step's timing and sync sample; ``window()`` reduces them to one metrics record."""

    def __init__(
        self, shape: BatchShape, device: torch.device, flops: TokenFlops, settings: MetricsConfig, tokens: TokenCount,
        tokens_seen: int = 0, clock: Callable[[], float] | None = None,
    ) -> None:
        """``settings``: ``metrics.*`` (the device's peak TFLOPS for MFU, the scaling baseline, how often the step
        breakdown is timed). ``clock``: the windows' wall clock in seconds (default: the host's, once the device's
        queued work is done); a test passes its own to make a window's arithmetic exact."""
        self.shape, self.device = shape, device
        self.clock = clock if clock is not None else (lambda: device_clock(device))
        self.tokens = tokens  # this rank's real and computed positions, counted as the micro batches are drawn
        self.tokens_seen = tokens_seen  # real tokens trained on by all ranks, up to the last window
        self._untimed = 0  # this rank's real tokens of steps left out of the windows (compilation)
        self.flops = flops
        # the device's peak TFLOPS (MFU's denominator); not a memory peak
        self.peak_tflops = settings.peak_tflops if settings.peak_tflops is not None else (
            peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        )
        self.baseline = load_baseline(settings.baseline)
        sample_every = settings.sample_every
        self.timer = StepTimer(device, sample_every)
        self.samples: list[SyncSample] = []
        self.compression_ratio: float | None = None
        self.buckets: tuple[tuple[float, int], ...] = ()  # the last timed step's bucket profile (for the predictor)
        self._start, self._steps = self._clock(), 0
        self._excluded = 0.0  # seconds of this window that were not training (a checkpoint's save)

    def start_step(self, step: int) -> None:
        self.timer.start_step(step)

    def end_step(self, sample: SyncSample | None, compression_ratio: float | None) -> None:
        if sample is not None and self.timer.active:
            if sample.exposed_s is not None:
                self.timer.add("backward", -sample.exposed_s)  # backward's wall time = compute + exposed sync
                self.timer.add("exposed_comm", sample.exposed_s)
            self.samples.append(sample)
            self.buckets = sample.buckets or self.buckets
        self.compression_ratio = compression_ratio
        self.timer.end_step()
        self._steps += 1

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside a window that is not training (a checkpoint's save): left out of its step time and
        throughput, as evaluation is. Sync point: the device's queued steps finish first, inside the window."""
        start = self._clock()
        try:
            yield
        finally:
            self._excluded += self._clock() - start

    def window(self, step: int, loss: float, lr: float, grad_norm: float) -> dict[str, Any]:
        """The record for the steps since the last window (wall clock, evaluation and checkpoints excluded)."""
        elapsed = self._clock() - self._start - self._excluded
        dp = self.shape.dp
        real, computed, squares = self._take_tokens()
        tokens_per_s = real / elapsed
        # attention over the sequences trained (each packed example its own): Σ T², not seq_len² per row
        flops = self.flops.per_token * real - self.flops.attention * (self.shape.seq_len * real - squares)
        sequences = self._steps * self.shape.global_batch_size
        metrics: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": elapsed / self._steps,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / dp,
            "padding_pct": 100.0 * (1 - real / computed) if computed else 0.0,
            "tokens_seen": self.tokens_seen,
            "tflops_per_rank": flops / elapsed / dp / 1e12,
            "tokens_per_sequence": real / sequences,  # real tokens per sequence (seq_len for fixed blocks)
            "attended_tokens": squares / real if real else 0.0,  # Σ T² / Σ T: attention's FLOPs per token grow with it
        }
        if (utilisation := mfu(metrics["tflops_per_rank"], self.peak_tflops)) is not None:
            metrics["mfu_pct"] = 100.0 * utilisation
        if self.baseline:
            metrics["scaling_efficiency"] = tokens_per_s / (dp * self.baseline)
        metrics.update(self.timer.window())
        metrics.update(sync_metrics(self.samples, dp))
        if self.compression_ratio is not None:
            metrics["compression_ratio"] = self.compression_ratio
        metrics.update(device_memory(self.device))
        self.samples.clear()
        return metrics

    def restart_window(self) -> None:
        """Start the next window now (after logging, evaluation or compilation, which are not training time)."""
        self._start, self._steps, self._excluded = self._clock(), 0, 0.0
        self.samples.clear()
        self.timer.window()  # drops the phase times of steps left out of the window
        self._untimed += self.tokens.take()[0]  # ... and their tokens from its throughput, not from tokens_seen

    def _take_tokens(self) -> tuple[int, int, int]:
        """All ranks' (real, computed, squared sequence lengths) since the last take; sync point: one small
        all-reduce."""
        counts = torch.tensor([*self.tokens.take(), self._untimed], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        real, computed, squares, untimed = (int(v) for v in counts.tolist())
        self.tokens_seen += real + untimed
        self._untimed = 0
        return real, computed, squares

    def _clock(self) -> float:
        return self.clock()


def steady_medians(history: list[dict[str, Any]]) -> dict[str, float]:
    """Median of every numeric metric over the logged windows after the first (warm-up: bucket rebuild, caches)."""
    steady = history[1:] or history
    skip = {"step", "tokens_seen", "loss", "val_loss", "lr", "grad_norm", "slowest_rank"}  # not steady quantities
    keys = [k for k, v in steady[-1].items() if isinstance(v, int | float) and k not in skip]
    return {k: statistics.median(m[k] for m in steady if k in m) for k in keys}
