"""Checkpoints that are never lost: written aside, committed by a marker and a rename, resumed exactly.

Layout of ``<run dir>/<checkpoint.dir>/step_000010/``: ``COMMITTED`` (JSON, written last), ``trainer.pt`` (step,
LR schedule, data position, batch, config), ``rng/rank{r}.pt`` (every rank's RNG states), and the model and
optimizer:

- DDP and our engines: rank 0's ``model.pt`` and ``optimizer.pt``;
- ZeRO-1: rank 0's ``model.pt`` and ``optimizer_groups.pt``, and a torch.distributed.checkpoint directory
  ``optim/`` where each rank writes the state of the parameters it owns, keyed by parameter name (so another
  world size can load it);
- FSDP2 (ZeRO-2/3): a torch.distributed.checkpoint directory ``state/`` with every rank's shards.

A directory without ``COMMITTED`` is a save that died half way: it is ignored and removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ddptrain.config import CheckpointConfig
from ddptrain.errors import ConfigError, flat
from ddptrain.faults import inject

log = logging.getLogger(__name__)
MARKER = "COMMITTED"


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int
    scheduler: dict[str, Any]
    epoch: int
    samples_in_epoch: int  # global samples of this epoch already consumed (all ranks)
    world_size: int
    global_batch_size: int
    zero_stage: int


def model_fingerprint(model: torch.nn.Module) -> str:
    """Names and shapes of the model's state: equal fingerprints mean the weights fit."""
    items = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, zero_stage: int) -> None:
        self.cfg = cfg
        self.root = run_dir / cfg.dir
        self.zero_stage = zero_stage
        self.rank = dist.get_rank()

    # ---- finding -------------------------------------------------------------------------------------------

    def committed(self, root: Path | None = None) -> list[Path]:
        root = root or self.root
        return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint ``train.resume`` names: auto -> the latest here (or none), a path -> that one."""
        if resume is None:
            return None
        if resume == "auto":
            found = self.committed()
            return found[-1] if found else None
        path = Path(resume)
        if (path / MARKER).is_file():
            return path
        for root in (path / self.cfg.dir, path):
            if found := self.committed(root):
                return found[-1]
        if not path.exists():
            raise ConfigError(f"train.resume={resume}: no such checkpoint or run directory")
        raise ConfigError(f"train.resume={resume}: no committed checkpoint there (expected step_*/{MARKER})")

    def remove_partial(self) -> None:
        """Rank 0 removes saves that died before their commit."""
        if self.rank == 0 and self.root.is_dir():
            for partial in self.root.glob(".tmp-step_*"):
                log.warning("removing a checkpoint that was never committed: %s", partial)
                shutil.rmtree(partial, ignore_errors=True)

    # ---- saving --------------------------------------------------------------------------------------------

    def save(self, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
        """Every rank writes its part into a temporary directory; rank 0 commits it with a marker and a rename."""
        final = self.root / f"step_{state.step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(_rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
        self._save_weights(tmp, model, optimizer)
        inject("save", state.step, self.rank)
        dist.barrier()
        if self.rank == 0:
            torch.save(vars(state), tmp / "trainer.pt")
            meta = {"step": state.step, "fingerprint": model_fingerprint(model), "zero_stage": self.zero_stage,
                    "world_size": state.world_size}
            (tmp / MARKER).write_text(json.dumps(meta) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune()
        dist.barrier()
        log.info("checkpoint saved: %s", final)
        return final

    def _save_weights(self, tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.zero_stage >= 2:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
            return
        if self.zero_stage == 1:
            dcp.save({"optim": _owned_optimizer_state(model, optimizer)}, checkpoint_id=str(tmp / "optim"))
        if self.rank == 0:
            torch.save(model.state_dict(), tmp / "model.pt")
            if self.zero_stage == 1:
                torch.save(_hyperparameters(optimizer), tmp / "optimizer_groups.pt")
            else:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")

    def _prune(self) -> None:
        for old in self.committed()[: -self.cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading -------------------------------------------------------------------------------------------

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Restore weights, optimizer and this rank's RNG from ``path``; returns the trainer state."""
        try:
            meta = json.loads((path / MARKER).read_text())
            state = TrainState(**torch.load(path / "trainer.pt", weights_only=False))
        except (OSError, ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise ConfigError(f"train.resume: {path} is not a readable checkpoint ({type(exc).__name__})") from exc
        if meta["fingerprint"] != model_fingerprint(model):
            raise ConfigError(f"train.resume: {path} was saved for a different model (parameter names or shapes "
                              "differ); use the same model.* settings or a new run directory")
        if meta["zero_stage"] != self.zero_stage:
            raise ConfigError(f"train.resume: {path} was saved with parallel.zero_stage={meta['zero_stage']}; "
                              f"resume with the same stage (got {self.zero_stage})")
        try:
            self._load_weights(path, model, optimizer)
        except (OSError, RuntimeError, EOFError, KeyError, ValueError) as exc:
            raise ConfigError(f"train.resume: {path} is corrupt ({flat(str(exc), 160)})") from exc
        rng = path / "rng" / f"rank{self.rank}.pt"
        if rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            log.warning("no RNG state for rank %d in %s (saved on %d ranks)", self.rank, path, state.world_size)
        return state

    def _load_weights(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.zero_stage >= 2:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            loaded = {"model": model_sd, "optim": optim_sd}
            dcp.load(loaded, checkpoint_id=str(path / "state"))
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
            return
        model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
        if self.zero_stage == 1:
            _load_owned_optimizer_state(model, optimizer, path / "optim")
            for group, saved in zip(optimizer.param_groups, torch.load(path / "optimizer_groups.pt"), strict=True):
                group.update(saved)
            return
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))

    # ---- export --------------------------------------------------------------------------------------------

    def export(self, model: torch.nn.Module, new_model: Callable[[], Any], tokenizer: Any, out: Path) -> None:
        """``save_pretrained`` of the full model (gathered from shards) and tokenizer, loadable by transformers.

        Every rank takes part in gathering; only rank 0 builds the unsharded copy it saves (``new_model()``).
        """
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            fresh = new_model()
            fresh.load_state_dict(full)
            fresh.save_pretrained(str(out))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out))
            log.info("model exported with save_pretrained: %s", out)
        dist.barrier()


def _owned_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-1: the state of the parameters this rank's shard owns, keyed by parameter name."""
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: dict(state) for p, state in optimizer.optim.state.items()}


def _load_owned_optimizer_state(model: torch.nn.Module, optimizer: Any, checkpoint: Path) -> None:
    """Read the state of the parameters this rank owns now (whatever rank wrote them) into its shard."""
    names = {p: n for n, p in model.named_parameters()}
    owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
    loaded = {names[p]: _adamw_state_like(p) for p in owned}
    dcp.load({"optim": loaded}, checkpoint_id=str(checkpoint))
    for p in owned:
        optimizer.optim.state[p] = loaded[names[p]]


def _adamw_state_like(param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param)}


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


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
