"""Where metrics go: a line on the console (and a progress bar), metrics.jsonl, and Weights & Biases."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ddptrain.config.schema import LoggerConfig, WandbConfig
from ddptrain.errors import flat

log = logging.getLogger(__name__)
Metrics = dict[str, Any]


class Sink(Protocol):
    def log(self, metrics: Metrics) -> None: ...
    def summary(self, figures: Metrics) -> None: ...  # the run's end-of-run figures (goodput)
    def close(self) -> None: ...


class ConsoleSink:
    """One log line per logged step; a progress bar (step, loss, tokens/s, ETA) when stdout is a terminal."""

    def __init__(self, total_steps: int, progress: bool) -> None:
        self.total = total_steps
        self.progress: Progress | None = None
        if progress and sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"), TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("train", total=total_steps, loss="-", tps="-")
            self.progress.start()

    def log(self, metrics: Metrics) -> None:
        step = metrics["step"]
        if self.progress is not None:
            self.progress.update(
                self.task, completed=step, loss=f"{metrics['loss']:.4f}", tps=f"{metrics['tokens_per_s']:,.0f}"
            )
        parts = [f"step {step}/{self.total}", f"loss {metrics['loss']:.4f}"]
        if "val_loss" in metrics:
            parts.append(f"val_loss {metrics['val_loss']:.4f}")
        parts += [
            f"lr {metrics['lr']:.2e}", f"grad_norm {metrics['grad_norm']:.3f}",
            f"{metrics['tokens_per_s']:,.0f} tok/s", f"{metrics['step_time_s'] * 1e3:.0f} ms/step",
        ]
        log.info(" | ".join(parts))

    def summary(self, figures: Metrics) -> None:
        pass  # the loop logs the run's last line itself

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class JsonlSink:
    """metrics.jsonl: one JSON object per logged step, flushed as written so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: Metrics) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def summary(self, figures: Metrics) -> None:
        pass  # per-step records only; summary.json holds the run's figures

    def close(self) -> None:
        self.file.close()


class WandbSink:
    """Rank 0's metrics in a W&B run with the resolved config; an unreachable W&B never stops training."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, cfg: WandbConfig, run_dir: Path, config: dict[str, Any]) -> WandbSink | None:
        try:
            import wandb

            run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.name, tags=list(cfg.tags),
                group=cfg.group,
                config=config, dir=str(run_dir), mode=cfg.mode or os.environ.get("WANDB_MODE"),
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", silent=True),
            )
        except Exception as exc:  # noqa: BLE001 - whatever W&B says, the run goes on without it
            log.warning("W&B unavailable, continuing without it: %s", flat(str(exc), 200))
            return None
        return cls(run)

    def log(self, metrics: Metrics) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def summary(self, figures: Metrics) -> None:
        self.run.summary.update(figures)  # the run's summary panel: goodput_pct and its breakdown

    def close(self) -> None:
        offline, sync_dir = self.run.offline, self.run.sync_dir
        self.run.finish()
        if offline:  # nothing was uploaded: say where the run is and how to upload it
            log.info("W&B run kept offline in %s; upload it with: wandb sync %s", sync_dir, shlex.quote(sync_dir))


class Sinks:
    """Fan-out to every configured sink (on rank 0; other ranks hold none)."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def build(
        cls, cfg: LoggerConfig, is_main: bool, run_dir: Path, total_steps: int, config: dict[str, Any]
    ) -> Sinks:
        if not is_main:
            return cls([])
        sinks: list[Sink] = [ConsoleSink(total_steps, cfg.progress)]
        if cfg.jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.wandb.enabled and (wandb_sink := WandbSink.open(cfg.wandb, run_dir, config)) is not None:
            sinks.append(wandb_sink)
        return cls(sinks)

    def log(self, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def summary(self, figures: Metrics) -> None:
        for sink in self.sinks:
            sink.summary(figures)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
