"""Every run checks the memory planner on itself: the peak per rank that the traced step plans for the run's
own configuration, beside the peak the run measured, in ``summary.json``'s ``memory_peak`` record.

Planned: one step of the configured model traced on fake tensors on one rank, then the ZeRO stage's sharding
for the run's world size (``memory_plan.configured_peak``, what the dry run prints), in the precision the run
computes in, plus DDP's gradient buckets (the allocator holds them); the assumed allowances (CUDA context,
fragmentation, NCCL) are not added, since ``max_memory_allocated`` does not see them either.

Measured (``telemetry/measured_peak.py``): on CUDA, ``torch.cuda.max_memory_allocated`` over the steady steps
(reset after the first step); on CPU, which has no allocator statistics, ``PeakTracker`` around one steady
step of the run (the second), on the run's real tensors, with the model state marked at its start (a 4-bit
base's quantization state included; its matmuls run as the same ops bitsandbytes' CPU kernel runs, so that the
tracker sees the dequantized weight the kernel holds). The tracker counts every storage the step's ops create
and free; the trace tests check it equals the CPU allocator's peak from ``torch.profiler`` on the
same step. It sees what the step allocates: DDP rebuilds its gradient buckets in the second step (in the
order the gradients arrived), so that step holds them too, as the plan counts them. The tracker slows that one
step down (a Python hook per op); it lies in the first logging window, which the steady medians skip unless
``train.log_every=1``.
"""

from __future__ import annotations

import copy
import logging
import os

import torch

from ddptrain.config.choices import Engine
from ddptrain.config.schema import Config
from ddptrain.plan.memory.overheads import RunOverheads
from ddptrain.plan.memory.planner import Allowances, configured_peak
from ddptrain.plan.memory.present import this_device
from ddptrain.runtime.process_group import device_precision

log = logging.getLogger("ddptrain")


def unplannable(cfg: Config, device: torch.device, world_size: int) -> str | None:
    """Why the trace cannot model this run, or None."""
    if cfg.train.compile:
        return "train.compile=true: the trace runs the eager step"
    if cfg.parallel.cpu_offload:
        return "parallel.cpu_offload=true: the trace keeps every tensor on the device"
    if cfg.parallel.engine != Engine.torch and world_size > 1:
        return f"parallel.engine={cfg.parallel.engine}: only torch DDP's gradient buckets are planned"
    if cfg.parallel.zero_stage == 1 and world_size > 1:
        return "parallel.zero_stage=1: DDP's gradient buckets beside ZeRO-1 are not planned"
    return None


def planned_peak(cfg: Config, world_size: int, device: torch.device, vocab: int, n_params: int
                 ) -> tuple[float | None, str]:
    """The planned peak per rank in bytes for this run (None when the trace cannot model it), and how.

    The run has finished when this runs: a trace that fails is reported, not raised, so it never costs the
    run its summary."""
    reason = unplannable(cfg, device, world_size)
    if reason is not None:
        return None, reason
    try:
        return _planned_peak(cfg, world_size, device, vocab, n_params)
    except Exception as exc:  # noqa: BLE001  # any failure of the trace: the run's own figures still stand
        log.warning("memory_peak: the traced plan failed (%s: %s)", type(exc).__name__, exc)
        return None, f"the trace failed: {type(exc).__name__}: {exc}"


def _planned_peak(cfg: Config, world_size: int, device: torch.device, vocab: int, n_params: int
                  ) -> tuple[float | None, str]:
    from ddptrain.plan.analytic.planner import build_plan

    traced_cfg = copy.deepcopy(cfg)
    traced_cfg.train.precision = device_precision(cfg.train.precision, device)  # as the run resolved it
    traced_cfg.plan.world_size = world_size
    traced_cfg.model.vocab_size = traced_cfg.data.vocab_size = vocab  # the run's embeddings (a pretrained base's own)
    target = this_device(device)
    plan = build_plan(traced_cfg, world_size, None)
    if round(plan.params) != n_params:
        return None, (f"model.* describes {plan.params:.0f} parameters, the run's model has {n_params}: "
                      "no shape to trace")
    by_category = configured_peak(traced_cfg, plan, vocab, target)[2]
    how = (f"traced step on one rank, ZeRO-{cfg.parallel.zero_stage} sharding for {world_size} ranks, "
           f"{traced_cfg.train.precision}")
    allowance = Allowances.for_run(target, by_category, cfg.parallel.zero_stage, world_size, 4.0 * plan.trainable,
                                   cfg.parallel.gradient_as_bucket_view, RunOverheads.of(cfg, world_size, os.environ))
    buckets = sum(v for k, v in allowance.items.items() if k.startswith("DDP gradient buckets"))
    how += ", + DDP's gradient buckets" if buckets else ""
    return sum(by_category.values()) + buckets, how
