"""``data.micro_batch_size=auto``: the largest micro batch whose traced step fits the device, chosen at start-up.

The traced memory plan decides (``memory_plan.Tracer``: fake tensors, nothing allocated on a device, no trial
and out-of-memory loop). A micro batch's need per rank is its step traced at one and two blocks and scaled by
depth (exact), sharded for the run's ZeRO stage, plus the planner's allowances; it fits when that is at most the
device's memory less ``AUTO_MARGIN``. The search aims with the fit through micro batches 1-3 (free once
traced), then with the line through the exact needs at micro batch 1 and at the fit's answer (``aimed_guess``),
doubles its step outward from there until the answer is bracketed, and bisects, each probe an exact trace.
``grad_accum`` is then derived so that the configured global batch holds: the micro batch is the largest
one that fits and divides the per-rank batch. When the model state alone (the planner's arithmetic) exceeds the
usable memory at every ZeRO stage weighed, nothing can fit and the answer comes before any trace.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

from ddptrain.config.choices import ActivationCheckpointing
from ddptrain.config.schema import AUTO_NEEDS_MEMORY, Config
from ddptrain.errors import ConfigError
from ddptrain.plan.analytic.planner import Plan, build_plan
from ddptrain.plan.memory.overheads import RunOverheads, ranks_per_node
from ddptrain.plan.memory.planner import (
    AUTO_MARGIN,
    RECOMPUTE,
    Allowances,
    Device,
    GiB,
    Tracer,
    checkpointing,
    compute_dtype,
    divisors,
    shard,
    usable_bytes,
)

# AUTO_MARGIN, the share of the device's memory auto leaves free, is the planner's: the dry run's options and
# recommendation are chosen against the same usable memory (``planner.usable_bytes``).


@dataclass(frozen=True)
class AutoBatch:
    """The micro batch ``auto`` chose, and why."""

    micro_batch: int
    grad_accum: int
    largest: int  # the largest micro batch that fits; micro_batch is the largest of those dividing the per-rank batch
    per_rank: int  # sequences per rank per optimizer step
    need: float  # bytes per rank at micro_batch, allowances included
    usable: float  # the device's free memory less the margin, in bytes
    device: Device

    def line(self) -> str:
        divides = "" if self.largest == self.micro_batch else (
            f"; {self.largest} fits but does not divide the {self.per_rank} sequences per rank")
        return (f"data.micro_batch_size=auto: micro batch {self.micro_batch}, grad_accum {self.grad_accum} "
                f"({self.need / GiB:.2f} of {self.usable / GiB:.2f} GiB usable per rank on {self.device.name}: "
                f"{self.device.memory_text()} less a {AUTO_MARGIN:.0%} margin{divides})")


@dataclass(frozen=True)
class StepNeed:
    """Bytes per rank of a step of the configured run, with the options the planner weighs."""

    tracer: Tracer
    plan: Plan  # model state, precision and the data-parallel size
    per_rank: int
    overheads: RunOverheads  # what the run's groups and allocator settings add beyond the trace

    def __call__(self, micro_batch: int, checkpointing: ActivationCheckpointing, stage: int,
                 chunked_loss: bool | None = None, fitted: bool = False) -> float:
        """Traced peak plus allowances; ``fitted``: from the fit through micro batches 1-3 (no new trace)."""
        cfg, device, plan = self.tracer.cfg, self.tracer.device, self.plan
        n, accumulating = plan.batch.dp, micro_batch < self.per_rank
        dtype = compute_dtype(cfg.train.precision, device)
        working_copy = (dtype is not None and plan.precision.gathered_bytes < plan.precision.param_bytes
                        and stage >= 2)
        if fitted:
            peak = self.tracer.fit(checkpointing, working_copy).peak_at(micro_batch, cfg.model.num_layers,
                                                                         accumulating)
        else:
            peak = self.tracer.exact(micro_batch, checkpointing, working_copy, accumulating, chunked_loss)
        categories = shard(peak.by_category, stage, n, plan, accumulating)
        allowances = Allowances.for_run(device, categories, stage, n, 4.0 * plan.trainable,
                                        cfg.parallel.gradient_as_bucket_view, self.overheads)
        return sum(categories.values()) + allowances.total


def largest_fitting(fits: Callable[[int], bool], limit: int, guess: int) -> int:
    """The largest m in 1..``limit`` with ``fits(m)`` (0: none), for ``fits`` that holds up to some m and not
    above: from ``guess``, the step doubles outward until the answer is bracketed, then bisection."""
    guess = min(max(guess, 1), limit)
    step = 1
    if fits(guess):
        lo, hi = guess, limit + 1
        while lo + step <= limit:
            if not fits(lo + step):
                hi = lo + step
                break
            lo, step = lo + step, step * 2
    else:
        lo, hi = 0, guess
        while hi - step >= 1:
            if fits(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def aimed_guess(need: Callable[[int], float], usable: float, limit: int, guess: int) -> int:
    """Where the line through the exact needs at micro batch 1 and at ``guess`` crosses ``usable``: the largest m
    it fits, in 1..``limit``. A step's need grows about linearly with the micro batch, so over that long a span the
    line aims within a micro batch or two where the fit of micro batches 1-3 (``guess``), extrapolated from a
    span of one, can miss by tens; each exact probe saved in the search after is two traces. It only aims: the
    search from it (``largest_fitting``) gives the same answer from any guess."""
    guess = min(max(guess, 1), limit)
    if guess == 1:
        return 1
    one, there = need(1), need(guess)
    if there <= one:
        return guess
    return min(max(int(1 + (usable - one) * (guess - 1) / (there - one)), 1), limit)


def planned_run(cfg: Config, dp: int, device: Device) -> Plan:
    """The planner's model state and precision for ``cfg`` on ``dp`` ranks of ``device`` (any micro batch)."""
    probe = copy.deepcopy(cfg)
    probe.data.micro_batch_size, probe.data.grad_accum, probe.plan.world_size = 1, None, dp
    if probe.data.global_batch_size % dp:
        raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by dp={dp}: "
                          "data.micro_batch_size=auto needs a whole number of sequences per rank")
    probe.data.global_batch_size = dp  # one sequence per rank: any micro batch plans the same model state
    return build_plan(probe, dp, device.name.upper() if device.device_type == "cuda" else None,
                      bf16_capable=device.bf16)


def choose_micro_batch(cfg: Config, dp: int, device: Device, vocab: int, tracer: Tracer | None = None,
                       overheads: RunOverheads | None = None) -> AutoBatch:
    """The largest micro batch that fits ``device`` (free memory less ``AUTO_MARGIN``) and divides the per-rank
    batch. ``overheads``: the run's (default: ``plan.nodes`` nodes, this process's allocator settings).
    ConfigError, naming what would make it fit, when even one sequence does not."""
    tracer = tracer or Tracer(cfg, vocab, device)
    per_rank = cfg.data.global_batch_size // dp
    overheads = overheads or RunOverheads.of(cfg, ranks_per_node(cfg, dp), os.environ)
    need = StepNeed(tracer, planned_run(cfg, dp, device), per_rank, overheads)
    usable = usable_bytes(device)
    refuse_unfittable_state(cfg, dp, device, need.plan)
    mode, stage = checkpointing(cfg), cfg.parallel.zero_stage

    def fits(m: int, fitted: bool = False) -> bool:
        return need(m, mode, stage, fitted=fitted) <= usable

    if not fits(1):
        raise ConfigError(nothing_fits(cfg, need, usable, device))
    largest = 1
    if per_rank > 1 and fits(per_rank):  # without accumulation: can fit alone (a full trace: the fit can miss)
        largest = per_rank
    elif per_rank > 1:
        below = per_rank - 1  # accumulating micro batches: their need grows with the micro batch
        guess = largest_fitting(lambda m: fits(m, fitted=True), below, 1)
        largest = largest_fitting(fits, below, aimed_guess(lambda m: need(m, mode, stage), usable, below, guess))
        if largest == below and fits(per_rank):
            largest = per_rank
    micro = max(d for d in divisors(per_rank) if d <= largest)
    return AutoBatch(micro, per_rank // micro, largest, per_rank, need(micro, mode, stage), usable, device)


def stages_weighed(cfg: Config, dp: int) -> range:
    """The ZeRO stages ``nothing_fits`` weighs: the configured one and, on several ranks, each higher one that the
    run allows (LoRA adapters: ZeRO-1 at most)."""
    stage = cfg.parallel.zero_stage
    return range(stage, ((1 if cfg.model.lora.enabled else 3) if dp > 1 else stage) + 1)


def refuse_unfittable_state(cfg: Config, dp: int, device: Device, plan: Plan | None = None) -> None:
    """ConfigError (``state_exceeds``' line) when the model state alone cannot fit ``device`` at any stage weighed:
    arithmetic only, no trace, so the launcher can ask it before any worker starts."""
    plan = plan or planned_run(cfg, dp, device)
    if (line := state_exceeds(cfg, plan, usable_bytes(device), device)) is not None:
        raise ConfigError(line)


def state_exceeds(cfg: Config, plan: Plan, usable: float, device: Device) -> str | None:
    """The one line when the model state alone (parameters, gradients, optimizer state per rank, the planner's
    arithmetic) exceeds the usable memory at every ZeRO stage weighed: then no micro batch, checkpointing or
    chunked loss can fit, and the answer is given before any step is traced (a trace takes seconds to a minute).
    A traced step holds at least this state (tests/test_auto_batch.py checks it), so the answer is certain."""
    stages = stages_weighed(cfg, plan.batch.dp)
    state = {s: plan.memory[s].total for s in stages}
    least = min(stages, key=state.__getitem__)
    if state[least] <= usable:
        return None
    at = f"parallel.zero_stage={least}" + ("" if len(stages) == 1 else
                                           f", the least of stages {stages[0]}-{stages[-1]} on {plan.batch.dp} ranks")
    return (f"data.micro_batch_size=auto: the model state alone (parameters, gradients, optimizer state) needs "
            f"{state[least] / GiB:.2f} GiB per rank ({at}), over the {usable / GiB:.2f} GiB usable on {device.name} "
            f"({device.memory_gib:g} GiB less a {AUTO_MARGIN:.0%} margin): no micro batch fits; a device with more "
            "memory (plan.device_memory_gib), more ranks to shard the state over, or a smaller model")


def nothing_fits(cfg: Config, need: StepNeed, usable: float, device: Device) -> str:
    """The one line when micro batch 1 does not fit: what alone (else together) would make it fit, from the
    options the planner weighs (checkpointing, a higher ZeRO stage, the chunked loss)."""
    configured, stage, chunked = checkpointing(cfg), cfg.parallel.zero_stage, cfg.train.chunked_loss
    remedies: list[tuple[str, dict]] = []
    remedies += [(f"model.activation_checkpointing={mode}", {"checkpointing": mode})  # selective, then full
                 for mode in sorted(ActivationCheckpointing, key=RECOMPUTE.__getitem__)
                 if RECOMPUTE[mode] > RECOMPUTE[configured]]
    remedies += [(f"parallel.zero_stage={s}", {"stage": s}) for s in stages_weighed(cfg, need.plan.batch.dp)[1:]]
    if not chunked:
        remedies.append(("train.chunked_loss=true", {"chunked_loss": True}))
    setting = {"checkpointing": configured, "stage": stage, "chunked_loss": chunked}
    gib = {text: need(1, **{**setting, **change}) / GiB for text, change in remedies}
    needs = need(1, configured, stage) / GiB
    head = (f"data.micro_batch_size=auto: even micro batch 1 needs {needs:.2f} GiB per rank, "
            f"over the {usable / GiB:.2f} GiB usable on {device.name} ({device.memory_text()} less a "
            f"{AUTO_MARGIN:.0%} margin)")
    alone = [f"{text} ({g:.2f} GiB)" for text, g in gib.items() if g * GiB <= usable]
    if alone:
        return f"{head}; it fits with {' or '.join(alone)}"
    if len(remedies) > 1:  # all of them at once: checkpointing, the highest stage, the chunked loss
        together = {k: v for _, change in remedies for k, v in change.items()}  # the last mode and stage: the most
        if (g := need(1, **{**setting, **together})) <= usable:
            names = [t for t, c in remedies if all(together[k] == v for k, v in c.items())]
            return f"{head}; it fits with {' and '.join(names)} together ({g / GiB:.2f} GiB)"
    tried = f" (tried: {', '.join(f'{t} ({g:.2f} GiB)' for t, g in gib.items())})" if remedies else ""
    return (f"{head}; nothing the planner weighs makes it fit{tried}: a device with more memory "
            "(plan.device_memory_gib) or a shorter data.seq_len")


def with_micro_batch(cfg: Config, micro_batch: int) -> Config:
    """``cfg`` with the micro batch chosen (grad_accum left to be derived from it)."""
    chosen = copy.deepcopy(cfg)
    chosen.data.micro_batch_size, chosen.data.grad_accum = micro_batch, None
    return chosen


def memory_unknown(cfg: Config, device: Device) -> ConfigError | None:
    """The error when ``auto`` has no memory to plan for: a CPU target without ``plan.device_memory_gib``."""
    if device.device_type == "cpu" and cfg.plan.device_memory_gib is None:
        return ConfigError(AUTO_NEEDS_MEMORY)
    return None
