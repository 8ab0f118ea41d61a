"""``profile.enabled=true``: torch.profiler over a few steady steps on rank 0 -> a Chrome trace and a PNG timeline."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ddptrain.config.schema import ProfileConfig

log = logging.getLogger(__name__)


class StepProfiler:
    """A torch.profiler session with a wait/warm-up/active schedule; ``step()`` after every optimizer step."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> None:
        self.trace = run_dir / f"trace_rank{rank}.json"
        self.run_dir = run_dir
        self.prof: profile | None = None
        if cfg.enabled and rank == 0:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.prof = profile(
                activities=activities,
                schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                on_trace_ready=lambda p: p.export_chrome_trace(str(self.trace)),
            )

    def __enter__(self) -> StepProfiler:
        if self.prof is not None:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(*exc)
        if exc[0] is None and self.trace.is_file():
            self._render()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def _render(self) -> None:
        from ddptrain.telemetry.timeline import render_timeline

        figures = render_timeline(self.trace, self.run_dir / "timeline.png")
        log.info("profile: Chrome trace %s, timeline %s (%s)", self.trace, self.run_dir / "timeline.png",
                 ", ".join(f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, float)))

