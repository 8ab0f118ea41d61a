"""Checkpoints that are never lost: written aside, committed by a marker and a rename, resumed under any strategy.

Saves are synchronous, or (``checkpoint.async_save``) staged to host memory and written by a background thread
while training goes on: at most one save is in flight, and the ``COMMITTED`` marker is written only once every
rank's files are complete, so a crash during the write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ddptrain.checkpoint.state import load_named_state, named_state
from ddptrain.config import Config
from ddptrain.errors import ConfigError, flat
from ddptrain.faults import inject
from ddptrain.runtime import main_only

log = logging.getLogger(__name__)
MARKER = "COMMITTED"
FORMAT = 2  # 2: one name-keyed DCP directory ``state/`` whatever the strategy


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int
    scheduler: dict[str, Any]
    epoch: int
    samples_in_epoch: int  # global samples of this epoch already consumed (all ranks): the data position
    world_size: int
    global_batch_size: int
    zero_stage: int
    grad_scaler: dict[str, Any] | None = None  # train.precision=fp16: the loss scale and its growth tracker
    stream: str | None = None  # data.streaming=true: every rank's reader position, as JSON text


def model_fingerprint(model: torch.nn.Module) -> str:
    """Names and (global) shapes of the model's state: equal fingerprints mean the weights fit, whatever the
    strategy (FSDP2's DTensors report their full shape)."""
    items = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def committed(root: Path) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first."""
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def find_checkpoint(path: Path, subdir: str, key: str) -> Path:
    """A checkpoint directory, or the latest committed one of a run directory (``<path>/<subdir>``)."""
    if (path / MARKER).is_file():
        return path
    for root in (path / subdir, path):
        if found := committed(root):
            return found[-1]
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such checkpoint or run directory")
    raise ConfigError(f"{key}={path}: no committed checkpoint there (expected step_*/{MARKER})")


def read_trainer_state(path: Path, key: str) -> tuple[dict[str, Any], TrainState]:
    """The marker's metadata and the trainer state; a one-line error when either cannot be read."""
    try:
        meta = json.loads((path / MARKER).read_text())
        state = TrainState(**torch.load(path / "trainer.pt", weights_only=False))
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"{key}: {path} is not a readable checkpoint ({type(exc).__name__})") from exc
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path} has checkpoint format {meta.get('format', 1)}; this ddptrain reads "
                          f"format {FORMAT} (name-keyed state/)")
    return meta, state


class Checkpointer:
    def __init__(self, cfg: Config, run_dir: Path, strategy: str, tokenizer: Any = None) -> None:
        """``strategy``: what holds the model (``Wrapped.strategy``), recorded in the marker and shown by ``info``
        and when a checkpoint is resumed under another."""
        self.cfg = cfg.checkpoint
        self.config = cfg  # written into every checkpoint, so ``info`` can diff it and ``export`` needs no run
        self.strategy = "the bare model" if strategy == "none" else strategy
        self.root = run_dir / cfg.checkpoint.dir
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        # Async saves coordinate on their own gloo group from a background thread, so their collectives never
        # interleave with training's on the default group. Created on every rank alike (a collective call).
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        self._group = dist.new_group(backend="gloo", timeout=timeout) if cfg.checkpoint.async_save else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if cfg.checkpoint.async_save else None
        self._pending: Future[None] | None = None  # the save in flight: done once its commit is

    # ---- finding -------------------------------------------------------------------------------------------

    def committed(self) -> list[Path]:
        return committed(self.root)

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint ``train.resume`` names: auto -> the latest here (or none), a path -> that one."""
        if resume is None:
            return None
        if resume == "auto":
            found = self.committed()
            return found[-1] if found else None
        return find_checkpoint(Path(resume), self.cfg.dir, "train.resume")

    def remove_partial(self) -> None:
        """Rank 0 removes saves that died before their commit."""
        if self.rank == 0 and self.root.is_dir():
            for partial in self.root.glob(".tmp-step_*"):
                log.warning("removing a checkpoint that was never committed: %s", partial)
                shutil.rmtree(partial, ignore_errors=True)

    # ---- saving --------------------------------------------------------------------------------------------

    def save(self, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             wait: bool = True) -> Path:
        """Every rank writes its part into a temporary directory; rank 0 commits it with a marker and a rename.

        With ``checkpoint.async_save`` the tensors are copied to host memory and written in the background;
        ``wait`` (the last save of a run, or a stop) still returns only once the checkpoint is committed.
        """
        started = time.perf_counter()
        self.wait()  # at most one save in flight: a slow disk blocks training here rather than piling up copies
        final = self.root / f"step_{state.step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(_rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
        meta = {"format": FORMAT, "step": state.step, "fingerprint": model_fingerprint(model),
                "strategy": self.strategy, "zero_stage": state.zero_stage, "world_size": state.world_size,
                "parameters": sum(p.numel() for p in model.parameters())}
        if self.rank == 0:
            self._write_metadata(tmp, state, model)
        named = named_state(model, optimizer)
        if self._writer is None:
            dcp.save(named, checkpoint_id=str(tmp / "state"))
            self._finish(state.step, tmp, final, meta, started)
            return final
        staged = dcp.async_save(named, checkpoint_id=str(tmp / "state"), process_group=self._group)
        blocked = time.perf_counter() - started
        self._pending = self._writer.submit(self._finish_async, staged, state.step, tmp, final, meta, started,
                                            blocked)
        if wait:
            self.wait()
            dist.barrier()  # every rank returns once rank 0 has committed
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raises its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write_metadata(self, tmp: Path, state: TrainState, model: torch.nn.Module) -> None:
        """Rank 0: the trainer state, the run's config and what ``export`` needs to rebuild the model offline."""
        torch.save(vars(state), tmp / "trainer.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(self.config)))
        model.config.save_pretrained(str(tmp / "hf"))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp / "hf"))

    def _finish(self, step: int, tmp: Path, final: Path, meta: dict[str, Any], started: float) -> None:
        """Synchronous save: every rank's files are written; rank 0 commits."""
        inject("save", step, self.rank)
        dist.barrier()
        if self.rank == 0:
            self._commit(tmp, final, meta)
        dist.barrier()
        log.info("checkpoint saved: %s (training blocked %.2f s)", final, time.perf_counter() - started)

    def _finish_async(self, staged: Future, step: int, tmp: Path, final: Path, meta: dict[str, Any],
                      started: float, blocked: float) -> None:
        """Background thread: wait for the write; rank 0 then commits. DCP's save ends with a step in which rank 0
        gathers every rank's write results, so rank 0's write completing means every rank's files are on disk."""
        inject("save", step, self.rank)  # a crash while the write is in flight must leave the previous checkpoint
        staged.result()
        if self.rank == 0:
            self._commit(tmp, final, meta)
            log.info("checkpoint saved: %s (training blocked %.2f s, background write %.2f s)", final, blocked,
                     time.perf_counter() - started)

    def _commit(self, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        (tmp / MARKER).write_text(json.dumps(meta) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.committed()[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading -------------------------------------------------------------------------------------------

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Restore weights, optimizer and this rank's RNG from ``path``; returns the trainer state.

        The state is keyed by parameter name, so a checkpoint of any strategy and world size loads here.
        """
        meta, state = read_trainer_state(path, "train.resume")
        if meta["fingerprint"] != model_fingerprint(model):
            raise ConfigError(f"train.resume: {path} was saved for a different model (parameter names or shapes "
                              "differ); use the same model.* settings or a new run directory")
        world_size = dist.get_world_size()
        if (meta["strategy"], meta["world_size"]) != (self.strategy, world_size):
            log.warning("resuming a checkpoint of %s on %d ranks under %s on %d ranks: model and optimizer state "
                        "are resharded by parameter name", meta["strategy"], meta["world_size"], self.strategy,
                        world_size)
        try:
            load_named_state(path / "state", model, optimizer)
        except (OSError, RuntimeError, EOFError, KeyError, ValueError) as exc:
            raise ConfigError(f"train.resume: {path} is corrupt ({flat(str(exc), 160)})") from exc
        rng = path / "rng" / f"rank{self.rank}.pt"
        if rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            log.warning("no RNG state for rank %d in %s (saved on %d ranks)", self.rank, path, state.world_size)
        return state

    # ---- export --------------------------------------------------------------------------------------------

    def export(self, model: torch.nn.Module, new_model: Callable[[], Any], tokenizer: Any, out: Path) -> None:
        """``save_pretrained`` of the full model (gathered from shards) and tokenizer, loadable by transformers.

        Every rank takes part in gathering; only rank 0 builds the unsharded copy it saves (``new_model()``),
        while the others wait on the store (``checkpoint.export_timeout_s``), not in a collective.
        """
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        def save() -> None:
            fresh = new_model()
            fresh.load_state_dict(full)
            fresh.save_pretrained(str(out))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out))
            log.info("model exported with save_pretrained: %s", out)

        main_only(save, self.cfg.export_timeout_s, "checkpoint.export_timeout_s", "exporting the model")


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
