"""Checkpoints that are never lost: written aside, committed by a marker and a rename, resumed under any strategy.

Saves are synchronous, or (``checkpoint.async_save``) staged to host memory and written by a background thread
while training goes on: at most one save is in flight, and the ``COMMITTED`` marker is written only once every
rank's files are complete, so a crash during the write leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ddptrain.checkpoint.format import (
    FORMAT,
    MANIFEST_KEY,
    MARKER,
    TrainState,
    committed,
    find_checkpoint,
    manifest,
    model_fingerprint,
    newest_intact,
    other_model,
    overwrite_refusal,
    read_trainer_state,
    total_bytes,
)
from ddptrain.checkpoint.safe import SafeReader, load_plain, rng_state, set_rng_state
from ddptrain.checkpoint.state import load_named_state, named_state
from ddptrain.config.schema import Config
from ddptrain.diagnose.trace import CHECKPOINT_GROUP
from ddptrain.errors import ConfigError, ResourceError, flat
from ddptrain.models.lora import export_adapter_and_merged, is_adapted
from ddptrain.runtime.hooks import StepHooks
from ddptrain.runtime.process_group import broadcast_from_main, main_only

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, cfg: Config, run_dir: Path, strategy: str, tokenizer: Any = None,
                 hooks: StepHooks | None = None) -> None:
        """``strategy``: what holds the model (``Wrapped.strategy``), recorded in the marker and shown by ``info``
        and when a checkpoint is resumed under another. ``hooks.before_commit`` is called while a save's files
        are written and not yet committed."""
        self.hooks = hooks or StepHooks()
        self.settings = cfg.checkpoint  # checkpoint.*
        # the whole config, written into every checkpoint, so ``info`` can diff it and ``export`` needs no run
        self.run_config = cfg
        self.strategy = "the bare model" if strategy == "none" else strategy
        self.root = run_dir / cfg.checkpoint.dir
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        # Async saves coordinate on their own gloo group from a background thread, so their collectives never
        # interleave with training's on the default group. Created on every rank alike (a collective call).
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        # Its description keeps its collectives out of the hang verdict's reading of the training's.
        self._group = dist.new_group(backend="gloo", timeout=timeout, group_desc=CHECKPOINT_GROUP) \
            if cfg.checkpoint.async_save else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if cfg.checkpoint.async_save else None
        self._pending: Future[None] | None = None  # the save in flight: done once its commit is
        self._saving: tuple[int, Path] = (0, self.root)  # the step and directory of the save in flight
        self.expected_bytes = 0  # about one checkpoint's size: estimated at start-up, then the largest written

    # ---- finding -------------------------------------------------------------------------------------------

    def committed(self) -> list[Path]:
        return committed(self.root)

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint ``train.resume`` names: auto -> the latest here (or none), a path -> that one."""
        if resume is None:
            return None
        explicit = resume != "auto"
        candidates = ([find_checkpoint(Path(resume), self.settings.dir, "train.resume")] if explicit
                      else self.committed())
        # Rank 0 reads every file once against the marker's record; every rank then takes its verdict.
        chosen, skipped, problem = broadcast_from_main(newest_intact(candidates) if self.rank == 0 else None)
        for path, problems in skipped:
            kept = Path(path).with_name(f"damaged-{Path(path).name}")
            log.warning("train.resume=auto: skipping the damaged checkpoint %s: %s; kept as %s", path, problems, kept)
        dist.barrier()  # every rank has seen the committed checkpoints before rank 0 moves the damaged aside
        if self.rank == 0:
            # Out of the way of this run's own save of the same step, and of keep_last's pruning: never deleted.
            for path, _ in skipped:
                Path(path).rename(Path(path).with_name(f"damaged-{Path(path).name}"))
        if chosen is None and problem:
            raise ConfigError(f"train.resume={resume}: {problem}")
        return Path(chosen) if chosen else None

    def refuse_overwrite(self, resume: str | None) -> None:
        """A fresh run (no ``train.resume``) into a run directory that holds committed checkpoints would replace
        them with its own: stop, unless ``checkpoint.overwrite`` says to."""
        found = self.committed()
        if resume is not None or not found:
            return
        if self.settings.overwrite:
            log.warning("checkpoint.overwrite=true: this run replaces the checkpoints in %s (latest %s)", self.root,
                        found[-1].name)
            return
        raise ConfigError(overwrite_refusal(self.root, found[-1]))

    def check_room(self, model: torch.nn.Module) -> None:
        """Rank 0 warns when the run dir's filesystem lacks room for ``keep_last`` + 1 checkpoints of this model."""
        self.expected_bytes = estimate_bytes(model)
        if self.rank != 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        needed = (self.settings.keep_last + 1) * self.expected_bytes
        if free < needed:
            log.warning("%s has %s free; checkpoint.keep_last=%d + 1 checkpoints of about %s each need %s: saves "
                        "may fail on a full disk", self.root, _mb(free), self.settings.keep_last,
                        _mb(self.expected_bytes), _mb(needed))

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
        meta = {"format": FORMAT, "step": state.step, "fingerprint": model_fingerprint(model),
                "strategy": self.strategy, "zero_stage": state.zero_stage, "world_size": state.world_size,
                "parameters": sum(p.numel() for p in model.parameters())}
        error = None
        try:
            torch.save(rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
            if self.rank == 0:
                self._write_metadata(tmp, state, model)
        except (OSError, RuntimeError) as exc:  # torch.save reports a short write as a RuntimeError
            error = exc
        # Every rank learns whether any rank's files failed, so none waits in a later barrier for a peer that quit.
        failures: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, self._local_failure(error, state.step, tmp) if error else None)
        if found := next((f for f in failures if f is not None), None):
            self._discard(tmp)
            full, message = found
            raise ResourceError(message) if full else RuntimeError(message)
        named = named_state(model, optimizer)
        if self._writer is None:
            try:
                dcp.save(named, checkpoint_id=str(tmp / "state"))
            except dcp.CheckpointException as exc:  # raised alike on every rank, with every rank's failure
                raise self._checkpoint_failure(exc, state.step, tmp) from exc
            self._finish(state.step, tmp, final, meta, started)
            return final
        self._saving = (state.step, tmp)
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
            try:
                pending.result()
            except dcp.CheckpointException as exc:
                raise self._checkpoint_failure(exc, *self._saving) from exc

    def _local_failure(self, exc: BaseException, step: int, tmp: Path) -> tuple[bool, str]:
        """(whether the disk is full, the sentence) for this rank's failed write of its own files."""
        if (message := self._disk_failure(exc, step)) is not None:
            return True, message
        return False, f"checkpoint of step {step} failed on rank {self.rank}: {type(exc).__name__}: {flat(str(exc))}"

    def _checkpoint_failure(self, exc: dcp.CheckpointException, step: int, tmp: Path) -> Exception:
        """A full disk as one sentence; any other failure of the write as it was."""
        for failure, _ in exc.failures.values():  # (the exception, its stack) of each rank that failed
            if (message := self._disk_failure(failure, step)) is not None:
                self._discard(tmp)
                return ResourceError(message)
        return exc

    def _discard(self, tmp: Path) -> None:
        """Rank 0 removes a save that failed before its commit, giving its room back."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _disk_failure(self, exc: BaseException, step: int) -> str | None:
        """The sentence for a save that ran out of room (which directory, needed and free, the last good
        checkpoint); None for another failure."""
        free = shutil.disk_usage(self.root).free
        full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            isinstance(exc, RuntimeError) and "unexpected pos" in str(exc) and free < self.expected_bytes)
        if not full:
            return None
        found = self.committed()
        last = (f"the last good checkpoint is {found[-1]} (continue from it with train.resume=auto once there is "
                "room)" if found else "no checkpoint of this run was committed before")
        return (f"checkpoint of step {step} failed: no space left in {self.root} (a checkpoint needs about "
                f"{_mb(self.expected_bytes)}, {_mb(free)} free); {last}")

    def _write_metadata(self, tmp: Path, state: TrainState, model: torch.nn.Module) -> None:
        """Rank 0: the trainer state, the run's config and what ``export`` needs to rebuild the model offline."""
        torch.save(state.record(), tmp / "trainer.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(self.run_config)))
        model.config.save_pretrained(str(tmp / "hf"))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp / "hf"))

    def _finish(self, step: int, tmp: Path, final: Path, meta: dict[str, Any], started: float) -> None:
        """Synchronous save: every rank's files are written; rank 0 commits."""
        self.hooks.before_commit(step)
        dist.barrier()
        if self.rank == 0:
            self._commit(tmp, final, meta)
        dist.barrier()
        log.info("checkpoint saved: %s (training blocked %.2f s)", final, time.perf_counter() - started)

    def _finish_async(self, staged: Future, step: int, tmp: Path, final: Path, meta: dict[str, Any],
                      started: float, blocked: float) -> None:
        """Background thread: wait for the write; rank 0 then commits. DCP's save ends with a step in which rank 0
        gathers every rank's write results, so rank 0's write completing means every rank's files are on disk."""
        self.hooks.before_commit(step)  # a crash while the write is in flight must leave the previous checkpoint
        staged.result()
        if self.rank == 0:  # the checksums are taken here, on the writer thread, not the training thread
            self._commit(tmp, final, meta)
            log.info("checkpoint saved: %s (training blocked %.2f s, background write %.2f s)", final, blocked,
                     time.perf_counter() - started)

    def _commit(self, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        """Record every file's size and checksum in the marker, then make the checkpoint visible by a rename."""
        meta = {**meta, MANIFEST_KEY: manifest(tmp, skip=frozenset({MARKER}))}
        self.expected_bytes = max(self.expected_bytes, total_bytes(meta[MANIFEST_KEY]))
        (tmp / MARKER).write_text(json.dumps(meta) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.committed()[: -self.settings.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading -------------------------------------------------------------------------------------------

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
        """Restore weights, optimizer and this rank's RNG from ``path``; returns the trainer state.

        The state is keyed by parameter name, so a checkpoint of any strategy and world size loads here.
        """
        meta, state = read_trainer_state(path, "train.resume")
        if meta["fingerprint"] != model_fingerprint(model):
            raise ConfigError(other_model(path))
        world_size = dist.get_world_size()
        if (meta["strategy"], meta["world_size"]) != (self.strategy, world_size):
            log.warning("resuming a checkpoint of %s on %d ranks under %s on %d ranks: model and optimizer state "
                        "are resharded by parameter name", meta["strategy"], meta["world_size"], self.strategy,
                        world_size)
        SafeReader(str(path / "state")).read_metadata()  # refused here, in one line, if it names other code
        try:
            load_named_state(path / "state", model, optimizer)
        except ConfigError:
            raise
        except (OSError, RuntimeError, EOFError, KeyError, ValueError) as exc:
            raise ConfigError(f"train.resume: {path} is corrupt ({flat(str(exc), 160)})") from exc
        rng = path / "rng" / f"rank{self.rank}.pt"
        if rng.is_file():
            set_rng_state(load_plain(rng))
        else:
            log.warning("no RNG state for rank %d in %s (saved on %d ranks)", self.rank, path, state.world_size)
        return state

    # ---- export --------------------------------------------------------------------------------------------

    def export(self, model: torch.nn.Module, run_dir: Path, new_model: Callable[[], Any] | None = None) -> None:
        """The trained model for transformers, the one export of a run: a LoRA run's adapter (``adapter/``, peft's
        format) and merged model (``model/``), else ``save_pretrained`` of the full model (gathered from shards)
        and the tokenizer in ``model/``.

        Rank 0 alone builds the copy it saves (``new_model()``, by default a fresh model of ``model``'s config),
        merges and writes (minutes for billions of parameters), while the other ranks wait on the store
        (``checkpoint.export_timeout_s``), which no collective timeout ends; every rank takes part in gathering.
        """
        if is_adapted(model):
            main_only(lambda: export_adapter_and_merged(model, self.run_config.model, self.tokenizer, run_dir),
                      self.settings.export_timeout_s, "checkpoint.export_timeout_s", "exporting the model")
            return
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out = run_dir / "model"

        def save() -> None:
            from transformers import AutoModelForCausalLM

            fresh = new_model() if new_model is not None else AutoModelForCausalLM.from_config(model.config)
            fresh.load_state_dict(full)
            fresh.save_pretrained(str(out))
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(out))
            log.info("model exported with save_pretrained: %s", out)

        main_only(save, self.settings.export_timeout_s, "checkpoint.export_timeout_s", "exporting the model")


def estimate_bytes(model: torch.nn.Module) -> int:
    """About the size of one checkpoint of ``model`` (all ranks together): its state, plus AdamW's two moments
    (fp32) for each trainable parameter."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    moments = sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad)
    return state + moments


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MB"
