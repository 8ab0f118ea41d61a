"""Train several configurations in one spawned process group, through the real ``train`` loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config

Overrides = dict[str, dict[str, Any]]  # config section -> key -> value

# Composed once here, where the fork server preloads this module: ``build_config`` builds the schema's defaults once
# per process (30 ms of the 50 a first call takes), so every forked rank starts with them built instead of building
# them again.
build_config()


def make_config(tmp: str, *layers: Overrides) -> Config:
    """The schema's defaults with each layer of overrides applied in turn (quiet, no export)."""
    quiet = {"data": {"cache_dir": tmp}, "logger": {"progress": False}, "checkpoint": {"export": False}}
    return build_config(quiet, *layers)


def without_the_planned_peak() -> None:
    """In this process, runs end without their summary's traced memory plan (``memory_peak``: a fake step traced by
    rank 0 at the end of every run, about 0.25 CPU s for the tiny models here, which the other ranks wait out):
    for the tests that check something else. ``tests/test_own_peak.py`` checks the plan, and every CLI run makes it."""
    from ddptrain.train import trainer

    assert hasattr(trainer, "planned_peak"), "the trainer's seam moved: point without_the_planned_peak at it"
    trainer.planned_peak = lambda *_: (None, "not traced here (tests/helpers/runs.py: trace_peak=False)")


def train_each(rank: int, world_size: int, tmp: str, base: Overrides, variants: list[Overrides],
               trace_peak: bool = False) -> list[dict]:
    """For ``run_distributed``: train ``base`` + each variant on this rank; rank 0 also returns metrics.jsonl.
    ``trace_peak=True`` keeps the summary's traced memory plan (``without_the_planned_peak``)."""
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import train

    if not trace_peak:
        without_the_planned_peak()
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    results = []
    for i, variant in enumerate(variants):
        run_dir = Path(tmp) / f"w{world_size}-run{i}"
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = train(make_config(tmp, base, variant), env, torch.device("cpu"), run_dir, {})
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
        results.append({"summary": summary, "metrics": [json.loads(line) for line in lines], "dir": str(run_dir)})
    return results


FaultSpec = str | dict[int, str] | None  # DDPTRAIN_FAULT for every rank, or each rank's own (by rank), or none


def train_outcomes(rank: int, world_size: int, tmp: str, base: Overrides,
                   variants: list[tuple[str, Overrides, FaultSpec]], trace_peak: bool = False,
                   ranks_per_node: int | None = None) -> list[dict[str, Any]]:
    """For ``run_distributed``: train ``base`` + each ``(name, overrides, DDPTRAIN_FAULT or None)`` in turn in
    ``<tmp>/<name>``, a run that ends early (``RunEnded``: an abort, a stop) included; per variant its summary (None
    when it ended early), the message and exit code it ended with, and rank 0's metrics.jsonl. A fault given by
    rank sets each rank's own (faults on several ranks at once: each spec names its own rank).

    Each run compiles afresh: dynamo's caches of an earlier run in this process would otherwise decide how a later
    run compiles. The summary's traced memory plan is left out unless ``trace_peak=True``, as in ``train_each``.
    ``ranks_per_node``: lay the ranks out as
    nodes of that many (HSDP's mesh), node by node; default one node of all."""
    import os

    from ddptrain.errors import RunEnded
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import train

    if not trace_peak:
        without_the_planned_peak()

    per_node = ranks_per_node or world_size
    env = DistEnv(rank=rank, local_rank=rank % per_node, world_size=world_size, local_world_size=per_node,
                  node_rank=rank // per_node)
    results = []
    for name, overrides, fault in variants:
        run_dir = Path(tmp) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        os.environ.pop("DDPTRAIN_FAULT", None)
        spec = fault.get(rank) if isinstance(fault, dict) else fault
        if spec:
            os.environ["DDPTRAIN_FAULT"] = spec
        summary, error, code = None, None, 0
        torch._dynamo.reset()  # each run compiles (train.compile) afresh, as in a process of its own
        try:
            summary = train(make_config(tmp, base, overrides), env, torch.device("cpu"), run_dir, {})
        except RunEnded as exc:
            error, code = str(exc), exc.exit_code
        finally:
            os.environ.pop("DDPTRAIN_FAULT", None)
        metrics = run_dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if rank == 0 and metrics.is_file() else []
        results.append({"summary": summary, "error": error, "exit_code": code, "dir": str(run_dir),
                        "metrics": [json.loads(line) for line in lines]})
    return results


def without_token_count(checkpoint: Path, dest: Path) -> int:
    """A copy of ``checkpoint`` at ``dest`` as a version before ``tokens_seen`` was recorded wrote it: its trainer
    state without the count (the recorded file sizes renewed, so that it still loads). Returns the count removed."""
    from ddptrain.checkpoint import MARKER
    from ddptrain.checkpoint.format import MANIFEST_KEY, manifest
    from ddptrain.checkpoint.safe import load_plain

    shutil.copytree(checkpoint, dest)
    state = load_plain(dest / "trainer.pt")
    recorded = state.pop("tokens_seen")
    torch.save(state, dest / "trainer.pt")
    marker = json.loads((dest / MARKER).read_text())
    marker[MANIFEST_KEY] = manifest(dest, skip=frozenset({MARKER}))
    (dest / MARKER).write_text(json.dumps(marker))
    return int(recorded)
