"""What one training step computes (accumulate with the gradient sync, clip, update) and the evaluation pass.

Each function says where the host waits for the device or for other ranks (a sync point): with fused AdamW a
steady step waits nowhere but in the gradient collective itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ddptrain.data.packing import to_device
from ddptrain.kernels.clip import clip_grad_norm
from ddptrain.optim import is_fused
from ddptrain.telemetry.timers import StepTimer
from ddptrain.train.control import guard_loss
from ddptrain.train.tokens import MicroBatch, accumulate_token_weighted, loss_tokens


def accumulate_gradients(
    module: torch.nn.Module, micro_batches: Iterator[torch.Tensor], grad_accum: int,
    maybe_sync: Callable[[bool], AbstractContextManager], autocast: AbstractContextManager,
    timer: StepTimer | None = None, token_weighted: bool = False,
    loss_guard: Callable[[torch.Tensor], torch.Tensor] = guard_loss,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
) -> torch.Tensor:
    """Forward/backward over ``grad_accum`` micro batches, syncing gradients only on the last one.

    Packed blocks: the loss is scaled by 1/grad_accum, so the synced ``.grad`` is the mean over the whole global
    batch. Returns this rank's mean loss over its micro batches. ``token_weighted`` (padded prompt/completion
    batches): the mean over every loss token of the global batch instead (see ``train/tokens.py``).
    ``loss_guard`` makes a non-finite loss poison the gradients, so the sync spreads it to every rank.
    ``scale_loss``: fp16's loss scaling before each backward (the returned loss is unscaled).
    """
    phase = timer.phase if timer is not None else (lambda _: nullcontext())
    if token_weighted:
        return accumulate_token_weighted(module, micro_batches, grad_accum, maybe_sync, autocast, phase,
                                         loss_guard, scale_loss)
    loss_sum: torch.Tensor | None = None
    for micro in range(grad_accum):
        with phase("data"):
            ids = next(micro_batches)
        with maybe_sync(micro == grad_accum - 1):  # the last micro batch's backward launches the gradient sync
            with phase("forward"), autocast:
                loss = loss_guard(module(input_ids=ids, labels=ids, use_cache=False).loss / grad_accum)
            with phase("backward"):
                scale_loss(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    assert loss_sum is not None
    return loss_sum


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
        getattr(optimizer, "optim", optimizer).found_inf = nonfinite.float()  # ZeRO-1: the local AdamW
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
