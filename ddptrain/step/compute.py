"""The pieces of one training step (``Trainer.train_step`` in ``train/trainer.py`` puts them in order): forward and
backward over the micro batches with the gradient sync on the last one, the non-finite verdict, clip, update; and
the evaluation pass.

Each function says where the host waits for the device or for other ranks (a sync point): with fused AdamW a
steady step waits nowhere but in the gradient collective itself; a check step agrees once (``step/control.py``).

The memory planner runs ``accumulate_gradients``, ``clip_gradients`` and ``apply_update`` too, on fake tensors
(``plan/memory/trace.py``): one definition of a step. So this module and what it imports sit below the planner
(``tests/test_layout.py``: the ``step`` package) and take no trainer state, only the model, optimizer, micro
batches and the callables that time, guard and weigh them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ddptrain.data.packing import to_device
from ddptrain.kernels.clip import clip_grad_norm
from ddptrain.optim import is_fused, local_optimizer
from ddptrain.step.control import NonFiniteError, guard_loss
from ddptrain.step.tokens import MicroBatch, loss_tokens
from ddptrain.step.weighting import MEAN_LOSS, Phase, Weighting

log = logging.getLogger("ddptrain")


@dataclass(frozen=True)
class Stepped:
    """What one step leaves for the loop: its loss and gradient norm (on the device), the learning rate it used,
    and at a check step what the ranks agreed on."""

    loss: torch.Tensor  # this rank's loss (see the run's weighting); averaged over ranks when logged
    grad_norm: torch.Tensor  # before clipping
    lr: float
    stop: int  # the agreed signal number at a check step; 0: go on
    skipped: int  # updates skipped for a non-finite loss or gradient, learned of at this check step


@dataclass(frozen=True)
class MicroStep:
    """What each micro batch's forward and backward pass through: ``phase`` times them (the step timer's phases),
    ``guard`` makes a non-finite loss poison the gradients, so the sync spreads it to every rank, and ``scale``
    is fp16's loss scaling before each backward (the returned loss is unscaled)."""

    phase: Phase = lambda _: nullcontext()
    guard: Callable[[torch.Tensor], torch.Tensor] = guard_loss
    scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss


PLAIN = MicroStep()


def accumulate_gradients(
    module: torch.nn.Module, micro_batches: Iterator[Any], grad_accum: int,
    maybe_sync: Callable[[bool], AbstractContextManager], autocast: AbstractContextManager,
    weighting: Weighting = MEAN_LOSS, around: MicroStep = PLAIN,
) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` micro batches, syncing gradients only on the last one; returns the sum
    of the micro batches' weighted losses (``weighting``: packed blocks' mean by default). ``around``: the
    timing, loss guard and loss scaling each micro batch passes through."""
    phase, loss_guard, scale_loss = around.phase, around.guard, around.scale
    loss_sum: torch.Tensor | None = None
    for micro, micro_loss in enumerate(weighting.micro_losses(micro_batches, grad_accum, phase)):
        with maybe_sync(micro == grad_accum - 1):  # the last micro batch's backward launches the gradient sync
            with phase("forward"), autocast:
                loss = loss_guard(micro_loss(module))
            with phase("backward"):
                scale_loss(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        del loss  # its graph, and what backward left in it, is not held through the next micro batch's forward
    assert loss_sum is not None
    return loss_sum


def settle_nonfinite(events: list[int], step: int, nan_policy: str) -> int:
    """At a check step: abort, or report the skipped updates (already skipped on every rank); returns their count.

    ``events``: the steps since the last check with a non-finite loss or gradients (fp16: a non-finite loss; an
    overflow from a finite loss is the scaler's back-off). Checks come before every checkpoint, so an aborted run
    never saves a state after its non-finite step.
    """
    count, first = len(events), events[0] if events else 0
    if count and nan_policy == "abort":
        raise NonFiniteError(f"non-finite loss or gradients at step {first} (train.nan_policy=abort); "
                             "no checkpoint was written for it")
    if count:
        more = f" and {count - 1} more up to step {step}" if count > 1 else ""
        log.warning("non-finite loss or gradients at step %d%s: update skipped on every rank", first, more)
    return count


def clip_gradients(model: torch.nn.Module, grad_clip: float, kernels: str = "auto") -> torch.Tensor:
    """Clip to ``grad_clip`` global norm (0: no clipping) on ``kernels``' norm and scaling (``parallel.kernels``);
    returns the norm before clipping.

    With clipping off only the norm is computed (it is logged and checked for non-finite values), never the
    scaling pass. With sharded gradients (FSDP2) the norm is a DTensor reduced over all shards (on the CPU with
    CPU offload, hence gloo next to NCCL); its full value is returned. The norm stays on the device: no sync.
    """
    grad_norm = clip_grad_norm(model.parameters(), grad_clip if grad_clip > 0 else None, kernels)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def apply_update(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """Step the optimizer unless this step's gradients are non-finite (a verdict the same on every rank).

    Fused AdamW takes the verdict as ``found_inf`` and skips on the device (parameters, moments and step count
    untouched), so the host waits for nothing. The other kernels cannot skip on a device flag: for them the
    host reads the verdict. Gradients are cleared either way.
    """
    if is_fused(optimizer):
        local_optimizer(optimizer).found_inf = nonfinite.float()  # ZeRO-1: the local AdamW
        optimizer.step()
    elif not bool(nonfinite):  # sync point (foreach / for_loop only): the host needs the verdict to branch
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def global_mean(value: torch.Tensor) -> float:
    """The mean of a per-rank scalar over all ranks (each rank saw the same number of tokens)."""
    buf = value.detach().double().reshape(1).clone()
    dist.all_reduce(buf)
    return float(buf) / dist.get_world_size()  # sync point: the host reads the reduced value


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[torch.Tensor | MicroBatch], autocast: AbstractContextManager,
    device: torch.device,
) -> float:
    """Mean validation loss over every rank's fixed batches (the same batches at every evaluation).

    Packed blocks: the mean of sequence means (every block has as many tokens); prompt/completion batches
    (padded or packed): the mean over their loss tokens. ``device`` is the run's: with CPU offload the parameters sit on
    the CPU while compute and NCCL use the GPU.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in batches:
        if isinstance(batch, dict):
            batch = to_device(batch, device)
            with autocast:  # num_items_in_batch=1: the model returns the summed token loss; no cache (packing)
                total[0] += model(**batch, num_items_in_batch=1, use_cache=False).loss.double()
            total[1] += loss_tokens(batch["labels"])
            continue
        ids = batch.to(device)
        with autocast:
            total[0] += model(input_ids=ids, labels=ids, use_cache=False).loss.double() * len(ids)
        total[1] += len(ids)
    model.train(was_training)  # back to training mode: checkpointing and dropout run again
    dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")  # sync point: once per evaluation
