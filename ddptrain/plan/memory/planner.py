"""Will it fit, and what is fastest: peak memory per rank from a traced step, for a target device, and the
configuration the planner recommends.

Every category of a phase's peak grows linearly with the number of transformer blocks (each block adds the
same parameters and saves the same activations per sequence), so one- and two-block traces of a micro batch
give its step at any depth, exactly; that is how every step the dry run prints is traced (``Tracer.exact``): the
configured one, each option's micro batch in each activation checkpointing mode, the by-checkpointing line. A fit
through micro batches 1, 2 and 3 (``PeakFit``) only tells ``data.micro_batch_size=auto`` where to start its search;
where it was traced, its gap from the full trace is reported.
ZeRO stages change the model state by the sharding formula of ``ddptrain/plan/analytic/planner.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ddptrain.config.choices import ActivationCheckpointing, Precision, resolve_precision
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.plan.analytic.planner import Plan, backward_seconds
from ddptrain.plan.costs import Comm
from ddptrain.plan.memory.host_cost import selective_host_bound
from ddptrain.plan.memory.overheads import RunOverheads
from ddptrain.plan.memory.trace import ACCUMULATING, StepSetup, fake_batch, fake_model_state, trace_step
from ddptrain.telemetry.storage_peak import CATEGORIES, PeakMemory, PeakTracker

GiB = 1024**3
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

# The share of the device's memory that a choice leaves free, beyond the planner's allowances: auto's micro batch,
# each option's largest micro batch and the recommendation are chosen against the same usable memory, so they
# agree (``usable_bytes``). A choice commits a run to a batch with nobody reading the plan, so it keeps room for
# what the trace cannot see (kernels' workspaces, a padded prompt/completion batch's mask, the allocator's
# fragmentation beyond the assumed 10%; see docs/memory_plan.md). 10% of an 80 GB card is 8 GB, several micro
# batches' activations of a 4B model.
AUTO_MARGIN = 0.10


@dataclass(frozen=True)
class Device:
    """A training device as the planner sees it: memory, bf16 support and dense peak throughput."""

    name: str
    memory_gib: float  # about what torch.cuda reports as total_memory (the card's nominal size, a little less)
    bf16: bool
    peak_tflops: float  # dense tensor-core peak in what train.precision=auto computes in: bf16, else fp16
    device_type: str = "cuda"
    in_use_gib: float = 0.0  # already in use when planned (another process, this one's context): a present GPU's
    nvls: bool = False  # an NVSwitch-class GPU (H100/H200 SXM and newer): NCCL may bind NVLink SHARP buffers
    context_in_use: bool = False  # in_use_gib was read by this process, so it holds this process's CUDA context

    @property
    def free_gib(self) -> float:
        """The memory the run can have: the total less what is already in use."""
        return self.memory_gib - self.in_use_gib

    def memory_text(self) -> str:
        """The memory as planned: "79.1 GiB", or "79.22 GiB (2.00 in use)" on a GPU already in use."""
        return f"{self.memory_gib:g} GiB" + (f" ({self.in_use_gib:.2f} in use)" if self.in_use_gib else "")


# Vendors' datasheet figures (dense, without sparsity), as in ddptrain/telemetry/peak.py.
DEVICES: dict[str, Device] = {
    "h200": Device("h200", 139.8, True, 989.0, nvls=True),
    "h100": Device("h100", 79.1, True, 989.0, nvls=True),
    "a100": Device("a100", 79.2, True, 312.0),
    "a100_40gb": Device("a100_40gb", 39.4, True, 312.0),
    "l40s": Device("l40s", 44.4, True, 362.0),
    "a10": Device("a10", 22.1, True, 125.0),
    "l4": Device("l4", 22.0, True, 121.0),
    "rtx4090": Device("rtx4090", 23.6, True, 165.0),
    "v100": Device("v100", 31.7, False, 125.0),
    "t4": Device("t4", 14.7, False, 65.0),
}


def target_device(name: str | None, memory_gib: float | None, peak_override: float | None) -> Device:
    """``plan.device`` (a name in ``DEVICES``, or cpu), with ``plan.device_memory_gib`` and
    ``metrics.peak_tflops`` overriding its figures; None: this machine's CPU."""
    if name in (None, "cpu"):
        host = psutil.virtual_memory().total / GiB
        device = Device("cpu", host, True, 0.0, "cpu")
    elif name in DEVICES:
        device = DEVICES[name]
    else:
        raise ConfigError(f"plan.device={name!r}: expected cpu or one of {', '.join(DEVICES)}")
    return replace(device, memory_gib=memory_gib or device.memory_gib,
                   peak_tflops=peak_override or device.peak_tflops)


def compute_dtype(precision: str, device: Device) -> torch.dtype | None:
    """``train.precision`` resolved for the target device, not this machine: auto is bf16 on a GPU with bf16,
    fp16 (loss-scaled) on one without (t4, v100), fp32 on a CPU."""
    resolved = resolve_precision(precision, device.device_type, device.bf16)
    return {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(resolved)


def checkpointing(cfg: Config) -> ActivationCheckpointing:
    """How the run recomputes its blocks' activations in backward: the one place the plan reads it."""
    return cfg.model.activation_checkpointing


@dataclass(frozen=True)
class TracedStep:
    """Which step to trace: ``micro_batch`` rows, ``num_layers`` blocks recomputed as ``checkpointing`` says,
    ``grad_accum`` micro batches, ``chunked_loss`` as ``train.chunked_loss`` (None: as configured)."""

    micro_batch: int
    checkpointing: ActivationCheckpointing
    num_layers: int
    grad_accum: int = 1
    chunked_loss: bool | None = None


# A fake model and its optimizer, with the mode their tensors belong to: any micro batch traces on them.
FakeState = tuple[FakeTensorMode, torch.nn.Module, torch.optim.Optimizer]


def trace_peak(cfg: Config, vocab: int, step: TracedStep, device: Device, working_copy: bool = False,
               states: dict[tuple, FakeState] | None = None) -> PeakTracker:
    """One traced step of ``cfg``'s model with ``step``'s changes (the rest as configured). ``working_copy``: on
    parameters in the compute dtype, as FSDP2 computes under mixed precision (ZeRO-2/3). A chunked loss runs on
    representative chunks (same peak).

    ``states``: fake models of this ``cfg``, ``vocab`` and ``device`` already built, by mode, depth, chunked loss
    and working copy (``Tracer``'s): a step of another micro batch or accumulation runs on the one built for
    its kind, with a fake batch of its own, instead of building the model, its fake storage and its optimizer
    state again (a sixth of a trace). A traced step leaves no gradient and changes no shape, so the trace is the
    same to the byte (tests/test_memory_trace.py)."""
    micro_batch, checkpointing, num_layers = step.micro_batch, step.checkpointing, step.num_layers
    grad_accum, chunked_loss = step.grad_accum, step.chunked_loss
    traced = copy.deepcopy(cfg)
    traced.model.activation_checkpointing = checkpointing
    traced.model.num_layers = num_layers
    if chunked_loss is not None:
        traced.train.chunked_loss = chunked_loss
    dtype = compute_dtype(cfg.train.precision, device)
    kind = (checkpointing, num_layers, traced.train.chunked_loss, working_copy)
    state = None if states is None else states.pop(kind, None)  # put back only after a step that ran to its end
    if state is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model_state = fake_model_state(traced, vocab, device.device_type, mode,
                                       dtype if working_copy else None, representative_chunks=True)
        state = (mode, *model_state)
    mode, model, optimizer = state
    batch = fake_batch(traced.data, micro_batch, mode)
    setup = StepSetup(device.device_type, dtype, cfg.optim.grad_clip, grad_accum, cfg.data.format)
    with mode:
        tracker, _ = trace_step(model, optimizer, batch, setup)
    if states is not None:
        states[kind] = state
    return tracker


Phases = dict[str, dict[str, int]]  # phase -> category -> bytes at that phase's peak


def highest(phases: dict[str, dict[str, float]], accumulating: bool) -> PeakMemory:
    """The highest phase's peak. Without accumulation (grad_accum 1) a step is the first micro batch of an
    accumulating one, then its update: the same phases less the later micro batches'."""
    kept = {p: c for p, c in phases.items() if accumulating or not p.endswith(ACCUMULATING)}
    phase = max(kept, key=lambda p: sum(kept[p].values()))
    return PeakMemory(round(sum(kept[phase].values())), {c: round(v) for c, v in kept[phase].items()}, phase)


@dataclass(frozen=True)
class PeakFit:
    """Each phase's peak, category by category, bilinear in the micro batch m and the number of blocks L; the
    step's peak is the highest phase's.

    Small traces at two depths d and d + 1 give the slope in L (identical blocks: exact, tests/test_memory_trace.py).
    At a traced micro batch that is all. In m, a phase's peak is the highest of its moments, each linear in m, so
    a line through two micro batches can miss where another moment overtakes: m = 1 is traced itself, larger
    micro batches follow the line through m = 2 and 3, and ``Tracer.exact`` traces the micro batch itself where
    the answer must hold (the configured step, auto, every option the dry run prints: ``plan_memory``).

    The formula combines the four corner traces (m = 2, 3 at the two depths) category by category, which holds
    only while the phase peaks at the same moment in all four. It need not: under CUDA's autocast lists a
    GPT-2 block saves fp32 activations, and its one-block step's backward peaks at the end (the tied
    embedding's fp32 gradient temporaries, the same at any m) while its two-block step's backward peaks in a
    block (growing with m): mixed, the slopes are garbage (negative gradients, 28 GiB of temporaries at
    micro batch 64 for a step that holds 2.8). A moment never holds less of any category with one block
    more or one micro batch more, so a category that shrinks between corners shows the switch
    (``moments_switch``); the fit then takes its depths one block deeper (``from_traces``), where the blocks'
    moments lead.
    """

    traced: dict[tuple[int, int], Phases]  # (m, L) -> phase -> category -> bytes
    depths: tuple[int, int] = (1, 2)  # the two depths traced at each micro batch: d and d + 1

    @classmethod
    def from_traces(cls, tracer: Tracer, checkpointing: ActivationCheckpointing, working_copy: bool = False,
                    micro_batches: tuple[int, ...] = (1, 2, 3)) -> PeakFit:
        """Traces at each of ``micro_batches`` (each an accumulating step) of one and two blocks, or of two and
        three where the corners' moments switch (and the model has three blocks)."""
        fit = cls({(m, n): tracer.phases(m, checkpointing, n, working_copy) for m in micro_batches for n in (1, 2)})
        if not moments_switch(fit.traced, micro_batches[-2:], fit.depths) or tracer.cfg.model.num_layers < 3:
            return fit
        deeper = (2, 3)
        return cls({(m, n): tracer.phases(m, checkpointing, n, working_copy) for m in micro_batches for n in deeper},
                   deeper)

    def peak_at(self, micro_batch: int, num_layers: int, accumulating: bool = True) -> PeakMemory:
        """The highest phase's peak, fitted for ``micro_batch`` and ``num_layers``; ``accumulating``: grad_accum
        above 1."""
        p, (d0, d1) = self.traced, self.depths
        m0, m1 = (micro_batch, micro_batch) if (micro_batch, d0) in p else (2, 3)
        dm, dl = micro_batch - m0, (num_layers - d0) / (d1 - d0)
        phases = {}
        for phase in p[m0, d0]:
            def at(m: int, n: int, c: str, phase: str = phase) -> float:
                return p[m, n][phase][c]

            phases[phase] = {
                c: at(m0, d0, c) + dm * (at(m1, d0, c) - at(m0, d0, c)) / max(m1 - m0, 1)
                + dl * (at(m0, d1, c) - at(m0, d0, c))
                + dm * dl * (at(m1, d1, c) - at(m1, d0, c) - at(m0, d1, c) + at(m0, d0, c)) / max(m1 - m0, 1)
                for c in CATEGORIES
            }
        return highest(phases, accumulating)

    def at(self, micro_batch: int, num_layers: int, accumulating: bool = True) -> dict[str, float]:
        """The categories at the highest of the phases' peaks, fitted for ``micro_batch`` and ``num_layers``."""
        return dict(self.peak_at(micro_batch, num_layers, accumulating).by_category)


def moments_switch(traced: dict[tuple[int, int], Phases], micro_batches: tuple[int, ...],
                   depths: tuple[int, int]) -> bool:
    """Whether some phase peaks at different moments among the corners: a category that holds less with one
    block more (at a micro batch) or with the larger micro batch (at a depth) than the corner before."""
    def shrinks(a: dict[str, int], b: dict[str, int]) -> bool:
        return any(b[c] < a[c] for c in a)

    m0, m1 = micro_batches
    d0, d1 = depths
    return any(shrinks(traced[m, d0][phase], traced[m, d1][phase]) for m in micro_batches for phase in traced[m, d0]) \
        or any(shrinks(traced[m0, d][phase], traced[m1, d][phase]) for d in depths for phase in traced[m0, d])


class Tracer:
    """Traced steps of one config for one target device, each traced once.

    A dry run asks for the same small step several times (the micro batch search, the fit, the configured step,
    the logits share); every trace here is an accumulating step (two micro batches), whose phases also give the
    step without accumulation (``highest``). The micro batches of one mode and depth are traced on one fake model
    and optimizer (``trace_peak``'s ``states``), built once.
    """

    def __init__(self, cfg: Config, vocab: int, device: Device) -> None:
        self.cfg, self.vocab, self.device = cfg, vocab, device
        self._traced: dict[tuple, Phases] = {}
        self._fits: dict[tuple[ActivationCheckpointing, bool], PeakFit] = {}
        self._states: dict[tuple, FakeState] = {}  # one fake model per mode and depth, for every micro batch

    def phases(self, micro_batch: int, checkpointing: ActivationCheckpointing, num_layers: int,
               working_copy: bool = False, chunked_loss: bool | None = None) -> Phases:
        chunked = self.cfg.train.chunked_loss if chunked_loss is None else chunked_loss
        key = (micro_batch, checkpointing, num_layers, working_copy, chunked)
        if key not in self._traced:
            traced = TracedStep(micro_batch, checkpointing, num_layers, 2, chunked)
            tracker = trace_peak(self.cfg, self.vocab, traced, self.device, working_copy, states=self._states)
            self._traced[key] = {phase: peak.by_category for phase, peak in tracker.phase_peaks.items()}
        return self._traced[key]

    def fit(self, checkpointing: ActivationCheckpointing, working_copy: bool = False) -> PeakFit:
        """The fit through micro batches 1, 2 and 3 (see ``PeakFit``)."""
        key = (checkpointing, working_copy)
        if key not in self._fits:
            self._fits[key] = PeakFit.from_traces(self, checkpointing, working_copy)
        return self._fits[key]

    def has_fit(self, checkpointing: ActivationCheckpointing, working_copy: bool = False) -> bool:
        """Whether the fit for this mode has been traced (auto's search traces it; the dry run's options do not)."""
        return (checkpointing, working_copy) in self._fits

    def exact(self, micro_batch: int, checkpointing: ActivationCheckpointing, working_copy: bool = False,
              accumulating: bool = True, chunked_loss: bool | None = None) -> PeakMemory:
        """The step of the configured depth at ``micro_batch``: one- and two-block traces of that micro batch,
        scaled by depth (equal to a trace of every block: tests/test_memory_trace.py)."""
        traced = {(micro_batch, n): self.phases(micro_batch, checkpointing, n, working_copy, chunked_loss)
                  for n in (1, 2)}
        return PeakFit(traced).peak_at(micro_batch, self.cfg.model.num_layers, accumulating)


def shard(by_category: dict[str, float], stage: int, world_size: int, plan: Plan, accumulating: bool = False
          ) -> dict[str, float]:
    """A single-rank step's categories under ZeRO ``stage`` on ``world_size`` ranks.

    Stage 1 keeps 1/N of the optimizer state. Stages 2-3 (FSDP2) keep 1/N of the fp32 parameters, gradients
    and optimizer state, and the working copy FSDP2 gathers: every parameter in stage 2, the root and one block
    in stage 3 (``plan.memory``'s figures). Under mixed precision the step is traced on a working copy in the
    compute dtype (``working_copy``), so activations and temporaries are FSDP2's; its low-precision
    gradients count at fp32. With gradient accumulation (``accumulating``) FSDP2 keeps the gradients
    unsharded, in fp32, until the last micro batch reduce-scatters them. An NF4 base is traced as bitsandbytes
    holds it (packed weights and their quantization state), so its parameters come from the trace.
    """
    out = dict(by_category)
    n = world_size
    if stage >= 1:
        out["optimizer"] = by_category["optimizer"] / n
    if stage >= 2:
        low = plan.precision.gathered_bytes < plan.precision.param_bytes  # traced on the working copy
        out["gradients"] = by_category["gradients"] * (plan.precision.grad_bytes / 2 if low else 1)
        out["gradients"] /= 1 if accumulating else n
        out["parameters"] = plan.memory[stage].params
        out["optimizer"] = plan.memory[stage].optimizer
        out["parameter copies"] = 0.0
    return out


# The CUDA context with cuBLAS's and cuDNN's workspaces, assumed; of it, the context itself (CUDA 12 loads
# kernels lazily: a few hundred MiB), which a present GPU's memory in use already holds once this process read it.
CUDA_CONTEXT_AND_WORKSPACES = 0.75 * GiB
CUDA_CONTEXT = 0.5 * GiB


def context_allowance(device: Device) -> dict[str, float]:
    """The allowance line for the CUDA context and workspaces: less the context where ``device``'s memory in use
    was read by this process (it is in there already; at most what was read)."""
    counted = min(CUDA_CONTEXT, device.in_use_gib * GiB) if device.context_in_use else 0.0
    label = "CUDA context, cuBLAS/cuDNN workspaces (assumed 0.75 GiB"
    if counted:
        label += f", less {counted / GiB:.2f} of this process's context already in the memory in use"
    return {label + ")": CUDA_CONTEXT_AND_WORKSPACES - counted}


@dataclass(frozen=True)
class Allowances:
    """What a trace of the step cannot see, per rank, in bytes: stated as assumptions, not measured."""

    items: dict[str, float]

    @classmethod
    def for_run(cls, device: Device, by_category: dict[str, float], stage: int, world_size: int,
                grad_bytes: float, bucket_view: bool, overheads: RunOverheads) -> Allowances:
        """DDP's buckets are allocated when it wraps the model and stay: at the peak they add a copy of every
        gradient; with ``gradient_as_bucket_view`` the gradients live in them, so only the part not yet
        produced at the peak is extra. NCCL's communicators and the allocator's fragmentation follow the run's
        groups and settings (``overheads.py``)."""
        peak = sum(by_category.values())
        items: dict[str, float] = {}
        if device.device_type == "cuda":
            items.update(context_allowance(device))
            share, why = overheads.fragmentation()
            items[f"allocator fragmentation and cache (assumed {share:.0%} of the peak: {why})"] = share * peak
            items.update(overheads.items(stage, world_size, device.nvls))
        if stage == 0 and world_size > 1:
            if bucket_view:
                items["DDP gradient buckets (holding the gradients)"] = grad_bytes - by_category["gradients"]
            else:
                items["DDP gradient buckets (a second copy of the gradients)"] = grad_bytes
        return cls(items)

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass(frozen=True)
class Option:
    """One configuration the recommendation weighs."""

    stage: int
    checkpointing: ActivationCheckpointing
    micro_batch: int
    grad_accum: int
    peak: float  # traced (fitted) peak per rank
    allowance: float
    step_s: float | None  # predicted step time; None without a device peak
    speedup: float | None  # over one device doing the same global batch
    accumulation: float = 0.0  # of ``peak``: what accumulating adds (earlier micro batches' gradients held)
    fit_gap: float | None = None  # the fit of small traces here over the full trace, minus 1; None: no fit traced

    @property
    def total(self) -> float:
        return self.peak + self.allowance


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def usable_bytes(device: Device) -> float:
    """The device's free memory (its total less what is already in use) less ``AUTO_MARGIN``: what every choice
    of the plan (auto, the options, the recommendation) fits into."""
    return device.free_gib * GiB * (1 - AUTO_MARGIN)


def largest_divisor_that_fits(need: Callable[[int, bool], float], per_rank: int, limit: float, guess: int
                              ) -> int | None:
    """The largest divisor d of ``per_rank`` whose step fits ``limit``: ``need(d, accumulating)`` is a full trace's
    bytes, accumulating where d is below ``per_rank``; None when even 1 does not fit.

    From ``guess`` (the fit's answer) it steps up while the next divisor fits, else down until one does: a right
    guess costs two probes, itself and the next divisor. The undivided batch is one step without accumulation,
    so it can fit where a smaller micro batch with accumulation (whose earlier micro batches' gradients are held)
    does not: it is asked too where the failed divisor's step would fit without accumulation (the same traces).
    The same answer as ``data.micro_batch_size=auto`` (``auto_batch.choose_micro_batch``) for its stage and mode.
    """
    ds = divisors(per_rank)

    def fits(d: int) -> bool:
        return need(d, d < per_rank) <= limit

    def undivided_instead(failed: int) -> bool:
        return failed != per_rank and need(failed, False) <= limit and fits(per_rank)

    i = ds.index(max(d for d in ds if d <= max(guess, 1)))
    if fits(ds[i]):
        while i + 1 < len(ds) and fits(ds[i + 1]):
            i += 1
        return per_rank if i + 1 < len(ds) and undivided_instead(ds[i + 1]) else ds[i]
    if undivided_instead(ds[i]):
        return per_rank
    return next((d for d in reversed(ds[:i]) if fits(d)), None)


@dataclass(frozen=True)
class StepCollectives:
    """One step's collectives per rank as ddptrain runs a ZeRO stage, split by what compute can hide them."""

    gathers: Comm  # FSDP2's parameter all-gathers, in every micro batch (it reshards after each backward)
    sync: Comm  # the gradient sync, in the last micro batch's backward (accumulation skips it before)
    after: Comm  # after the update, with nothing to hide under


def step_collectives(plan: Plan, stage: int) -> StepCollectives:
    """Stage 0 all-reduces the gradients. Stage 1 is ZeroRedundancyOptimizer over DDP: the same all-reduce, then
    each rank sends its updated fp32 shard to the others. Stage 2 all-gathers the working copy in each micro
    batch's forward, stage 3 in its forward and again in its backward; both reduce-scatter the gradients once."""
    n = plan.batch.dp
    share, hops = (n - 1) / n * plan.trainable, n - 1
    none = Comm(0.0, 0)
    if stage <= 1:
        all_reduce = Comm(2 * share * plan.precision.grad_bytes, 2 * hops)
        after = Comm(share * plan.precision.param_bytes, hops) if stage == 1 else none
        return StepCollectives(none, all_reduce, after)
    rounds = 2 if stage == 3 else 1
    return StepCollectives(Comm(rounds * share * plan.precision.gathered_bytes, rounds * hops),
                           Comm(share * plan.precision.grad_bytes, hops), none)


# Compute per step relative to no checkpointing. Full checkpointing runs each block's forward again (a forward is
# a third of a step's FLOPs); selective recomputes no matmul, only memory-bound element-wise ops that a FLOP count
# does not see: assumed 5% of the step.
RECOMPUTE = {ActivationCheckpointing.none: 1.0, ActivationCheckpointing.selective: 1.05,
             ActivationCheckpointing.full: 4 / 3}


def predicted_step_s(plan: Plan, device: Device, stage: int, checkpointing: ActivationCheckpointing,
                     micro_batch: int, grad_accum: int, ranks: int) -> float | None:
    """Compute at the assumed MFU (times ``RECOMPUTE`` for the checkpointing mode) plus the communication that compute
    cannot hide, each collective timed by the planner's α–β link (``plan.link``): every micro batch's
    all-gathers beyond that micro batch's compute, the gradient sync beyond the last micro batch's backward,
    and what runs after the update."""
    if not device.peak_tflops:
        return None
    tokens = micro_batch * grad_accum * plan.sequence_tokens  # real tokens: prompt/completion rows are shorter
    compute = plan.flops_per_token * tokens / (device.peak_tflops * 1e12 * plan.assumed_mfu)
    compute *= RECOMPUTE[checkpointing]
    if ranks == 1:
        return compute
    comm = step_collectives(plan, stage)
    backward = backward_seconds(plan.flops_per_token, micro_batch * plan.sequence_tokens, device.peak_tflops,
                                plan.assumed_mfu)
    exposed = (grad_accum * max(0.0, plan.link.seconds(comm.gathers) - compute / grad_accum)
               + max(0.0, plan.link.seconds(comm.sync) - backward) + plan.link.seconds(comm.after))
    return compute + exposed


@dataclass(frozen=True)
class LogitsShare:
    """The LM head's and the loss's share of the peak with ``train.chunked_loss`` on and off.

    Both from one-block traces of the configured micro batch (the share does not depend on the depth); the
    per-rank peak of the setting not configured is the configured one plus the one-block traces' difference.
    """

    chunk_tokens: int | None  # tokens per chunk when on; None: the model's head keeps the full logits
    bytes: dict[str, float]  # "chunked" / "full logits" -> "logits and loss" bytes at the step's peak
    peak: dict[str, float]  # the same keys -> the step's peak per rank

    def to_json(self) -> dict:
        return {"chunk_tokens": self.chunk_tokens,
                **{k: {"logits_and_loss_bytes": round(v), "peak_bytes_per_rank": round(self.peak[k])}
                   for k, v in self.bytes.items()}}


def logits_share(tracer: Tracer, micro_batch: int, working_copy: bool, accumulating: bool, configured_peak: float
                 ) -> LogitsShare:
    """Trace one block at the configured micro batch with the chunked loss on and off (see ``LogitsShare``)."""
    from ddptrain.models.chunked_loss import chunk_tokens_for

    cfg = tracer.cfg
    traced = {on: highest(tracer.phases(micro_batch, checkpointing(cfg), 1, working_copy, on), accumulating)
              for on in (True, False)}
    names = {True: "chunked", False: "full logits"}
    here = traced[cfg.train.chunked_loss].peak
    chunked = traced[True].by_category["logits and loss"] != traced[False].by_category["logits and loss"]
    # LoRA freezes the head (an adapted head keeps the full logits)
    device_chunk = chunk_tokens_for(tracer.vocab, tracer.device.device_type, not cfg.model.lora.enabled)
    chunk = (cfg.train.loss_chunk_tokens or device_chunk) if chunked else None
    return LogitsShare(chunk, {names[on]: t.by_category["logits and loss"] for on, t in traced.items()},
                       {names[on]: configured_peak + t.peak - here for on, t in traced.items()})


@dataclass(frozen=True)
class MemoryPlan:
    """The configured step's traced peak per rank on the target device, and the recommendation."""

    device: Device
    dtype: str  # what the step computes in on the target device
    micro_batch: int
    checkpointing: ActivationCheckpointing
    stage: int
    traced: PeakMemory  # the configured step, one rank, no sharding
    by_category: dict[str, float]  # ... under the configured ZeRO stage
    allowances: Allowances
    fit_gap: float | None  # the fit's peak at the configured size over the full trace's, minus 1; None: no fit
    options: list[Option]  # the best micro batch per stage and checkpointing mode, fastest first; fits only
    # checkpointing mode -> the fitted categories of the configured micro batch, depth and stage in that mode
    by_mode: dict[ActivationCheckpointing, dict[str, float]]
    logits: LogitsShare | None = None  # the head's and loss's share with train.chunked_loss on and off
    configured_chunked: bool = True  # train.chunked_loss as configured
    host_note: str | None = None  # eager selective checkpointing bound by the host (host_cost.py)
    usable: float = 0.0  # the memory every option is chosen against: the free memory less AUTO_MARGIN

    @property
    def peak(self) -> float:
        return sum(self.by_category.values())

    @property
    def total(self) -> float:
        return self.peak + self.allowances.total

    @property
    def fits(self) -> bool:
        return self.total <= self.device.free_gib * GiB

    @property
    def recommendation_note(self) -> str | None:
        """Why the recommendation's micro batch is smaller than another option's that fits, when it is: the
        larger one's predicted step beside the recommendation's (or, without a device peak to predict with, the
        rule that ranked it: less recompute, then a lower stage)."""
        if not self.options:
            return None
        best = self.options[0]
        larger = [o for o in self.options if o.micro_batch > best.micro_batch]
        if not larger:
            return None
        other = max(larger, key=lambda o: o.micro_batch)  # the fastest of the largest: options are fastest first
        head = (f"micro batch {other.micro_batch} (grad_accum {other.grad_accum}, checkpointing {other.checkpointing}, "
                f"{STAGE_NAMES[other.stage]}) fits too")
        if best.step_s is None or other.step_s is None:
            return f"{head} but ranks after it: no device peak to predict step times, so less recompute ranks first"
        why = "slower" if other.step_s > best.step_s else "no faster (ties go to less recompute, then a lower stage)"
        return f"{head} but is predicted {why}: {other.step_s * 1e3:,.1f} ms against {best.step_s * 1e3:,.1f} ms"

    def to_json(self) -> dict:
        best = self.options[0] if self.options else None
        return {
            "device": self.device.name, "device_memory_bytes": self.device.memory_gib * GiB,
            "compute_dtype": self.dtype, "micro_batch_size": self.micro_batch,
            "activation_checkpointing": str(self.checkpointing), "zero_stage": self.stage,
            "peak_bytes_per_rank": round(self.peak), "peak_phase": self.traced.phase,
            "by_category": {c: round(v) for c, v in self.by_category.items()},
            "single_rank_by_category": self.traced.by_category,
            "allowances": {k: round(v) for k, v in self.allowances.items.items()},
            "total_bytes_per_rank": round(self.total), "fits": self.fits, "fit_gap": self.fit_gap,
            "usable_bytes_per_rank": round(self.usable),
            "recommendation": None if best is None else option_json(best),
            "recommendation_note": self.recommendation_note,
            "options": [option_json(o) for o in self.options],
            "by_checkpointing": {str(mode): {"activations_bytes": round(by["activations"]),
                                             "peak_bytes_per_rank": round(sum(by.values()))}
                                 for mode, by in self.by_mode.items()},
            "chunked_loss": self.chunked_loss,
            "logits_and_loss": None if self.logits is None else self.logits.to_json(),
            "host_note": self.host_note,
        }

    @property
    def chunked_loss(self) -> bool:
        return self.logits is not None and self.logits.chunk_tokens is not None and self.configured_chunked


def option_json(option: Option) -> dict:
    return {"zero_stage": option.stage, "activation_checkpointing": str(option.checkpointing),
            "micro_batch_size": option.micro_batch, "grad_accum": option.grad_accum,
            "peak_bytes_per_rank": round(option.peak), "total_bytes_per_rank": round(option.total),
            "accumulation_bytes": round(option.accumulation), "fit_gap": option.fit_gap,
            "predicted_step_s": option.step_s, "predicted_speedup": option.speedup}


def configured_peak(cfg: Config, plan: Plan, vocab: int, device: Device
                    ) -> tuple[PeakMemory, PeakMemory, dict[str, float]]:
    """The configured step on ``device``: its single-rank trace, the trace the ZeRO stage is sharded from (on
    FSDP2's low-precision working copy under mixed precision at stages 2-3, else the same) and, by category,
    the peak per rank under the configured stage on ``plan``'s world size (without allowances)."""
    batch = plan.batch
    dtype = compute_dtype(cfg.train.precision, device)
    low = dtype is not None and plan.precision.gathered_bytes < plan.precision.param_bytes  # FSDP2 mixed precision

    def trace_configured(working_copy: bool) -> PeakMemory:
        step = TracedStep(batch.micro_batch_size, checkpointing(cfg), cfg.model.num_layers, min(batch.grad_accum, 2))
        return trace_peak(cfg, vocab, step, device, working_copy).peak

    traced = trace_configured(False)
    stage_traced = trace_configured(True) if low and cfg.parallel.zero_stage >= 2 else traced
    return traced, stage_traced, shard(stage_traced.by_category, cfg.parallel.zero_stage, batch.dp, plan,
                                       batch.grad_accum > 1)


def plan_memory(cfg: Config, plan: Plan, vocab: int, device: Device, overheads: RunOverheads,
                tracer: Tracer | None = None) -> MemoryPlan:
    """Trace the configured step for ``device``, then weigh every stage, checkpointing mode and micro batch.
    ``tracer``: traces already taken of this config on this device (the micro batch search's).

    One model of memory: every figure here is a full trace (``Tracer.exact``: one- and two-block traces of that
    micro batch, scaled by depth) sharded for its stage, plus the allowances, as ``data.micro_batch_size=auto``
    weighs it. Each option's micro batch is the largest divisor of the per-rank batch whose full trace fits the
    usable memory (``usable_bytes``, auto's), and the next larger one's does not (``largest_divisor_that_fits``,
    starting from the configured micro batch, which the by-checkpointing line traces in every mode). No fit of
    small traces stands in for a figure; where auto's search traced one (it starts from it), its miss at each
    option's micro batch and at the configured one is kept (``fit_gap``). Modes are weighed from the least
    recompute to the most (none, selective, full); a mode that fits the whole per-rank batch in one micro batch
    ends the stage's search, as more recompute cannot make that faster."""
    tracer = tracer or Tracer(cfg, vocab, device)
    batch = plan.batch
    n, stages = batch.dp, ((0, 1) if cfg.model.lora.enabled else (0, 1, 2, 3)) if batch.dp > 1 else (0,)
    layers, mode, stage = cfg.model.num_layers, checkpointing(cfg), cfg.parallel.zero_stage
    dtype = compute_dtype(cfg.train.precision, device)
    low = dtype is not None and plan.precision.gathered_bytes < plan.precision.param_bytes  # FSDP2 mixed precision
    accumulating = batch.grad_accum > 1
    grad_bytes = 4.0 * plan.trainable  # fp32 gradients (adapters are fp32 too)
    limit = usable_bytes(device)

    def allowances(by_category: dict[str, float], stage: int) -> Allowances:
        return Allowances.for_run(device, by_category, stage, n, grad_bytes, cfg.parallel.gradient_as_bucket_view,
                                  overheads)

    def planned(micro_batch: int, c: ActivationCheckpointing, stage: int, accumulating: bool,
                fitted: bool = False) -> dict[str, float]:
        """The categories per rank at ``stage``: a full trace, or (``fitted``) the fit of small traces."""
        working_copy = low and stage >= 2
        peak = (tracer.fit(c, working_copy).peak_at(micro_batch, layers, accumulating) if fitted
                else tracer.exact(micro_batch, c, working_copy, accumulating))
        return shard(peak.by_category, stage, n, plan, accumulating)

    def need(micro_batch: int, c: ActivationCheckpointing, stage: int, accumulating: bool) -> float:
        categories = planned(micro_batch, c, stage, accumulating)
        return sum(categories.values()) + allowances(categories, stage).total

    def fit_gap(micro_batch: int, c: ActivationCheckpointing, stage: int, accumulating: bool) -> float | None:
        """The fit of small traces over the full trace, minus 1, where a fit was traced (auto's search starts
        from it); None where none was: nothing then stood in for a full trace."""
        if not tracer.has_fit(c, low and stage >= 2):
            return None
        fitted = sum(planned(micro_batch, c, stage, accumulating, fitted=True).values())
        return fitted / sum(planned(micro_batch, c, stage, accumulating).values()) - 1

    traced = tracer.exact(batch.micro_batch_size, mode, False, accumulating)
    stage_traced = tracer.exact(batch.micro_batch_size, mode, True, accumulating) if low and stage >= 2 else traced
    configured = shard(stage_traced.by_category, stage, n, plan, accumulating)
    options = []
    per_rank = batch.global_batch_size // n
    modes = sorted(ActivationCheckpointing, key=RECOMPUTE.__getitem__)
    for option_stage in stages:
        for c in modes:
            # from the configured micro batch, whose full trace the by-checkpointing line needs in every mode
            m = largest_divisor_that_fits(lambda m, acc, c=c, s=option_stage: need(m, c, s, acc), per_rank, limit,
                                          batch.micro_batch_size)
            if m is None:
                continue
            option = weigh(Weighed(plan, device, option_stage, c, m, per_rank // m), planned, allowances)
            options.append(replace(option, fit_gap=fit_gap(m, c, option_stage, m < per_rank)))
            if m == per_rank:
                break
    options.sort(key=lambda o: (o.step_s if o.step_s is not None else 0.0, o.stage, RECOMPUTE[o.checkpointing]))
    by_mode = {c: configured if c == mode else planned(batch.micro_batch_size, c, stage, accumulating)
               for c in modes}
    chosen = next((o for o in options[:1] if o.checkpointing == ActivationCheckpointing.selective), None)
    note_mode, note_micro = (chosen.checkpointing, chosen.micro_batch) if chosen else (mode, batch.micro_batch_size)
    return MemoryPlan(
        device=device, dtype=str(dtype or torch.float32).removeprefix("torch."),
        micro_batch=batch.micro_batch_size, checkpointing=mode, stage=stage, traced=traced,
        by_category=configured, allowances=allowances(configured, stage),
        fit_gap=fit_gap(batch.micro_batch_size, mode, stage, accumulating), options=options, by_mode=by_mode,
        logits=logits_share(tracer, batch.micro_batch_size, low and stage >= 2, accumulating, sum(configured.values())),
        configured_chunked=cfg.train.chunked_loss,
        host_note=selective_host_bound(note_mode, cfg.train.compile, block_seconds(plan, device, note_micro, layers),
                                       note_micro),
        usable=limit,
    )


@dataclass(frozen=True)
class Weighed:
    """An option's setting: ``micro_batch`` × ``grad_accum`` at ``stage`` in ``checkpointing`` mode."""

    plan: Plan
    device: Device
    stage: int
    checkpointing: ActivationCheckpointing
    micro_batch: int
    grad_accum: int


def weigh(w: Weighed, planned: Callable[..., dict[str, float]],
          allowances: Callable[[dict[str, float], int], Allowances]) -> Option:
    """``w`` as an option: its full trace's bytes (and what accumulating adds to them), its allowances and its
    predicted step."""
    accumulating = w.grad_accum > 1
    categories = planned(w.micro_batch, w.checkpointing, w.stage, accumulating)
    peak = sum(categories.values())
    alone = sum(planned(w.micro_batch, w.checkpointing, w.stage, False).values()) if accumulating else peak
    n = w.plan.batch.dp
    step = predicted_step_s(w.plan, w.device, w.stage, w.checkpointing, w.micro_batch, w.grad_accum, n)
    single = (predicted_step_s(w.plan, w.device, 0, w.checkpointing, w.micro_batch, w.grad_accum * n, 1)
              if step else None)
    return Option(w.stage, w.checkpointing, w.micro_batch, w.grad_accum, peak,
                  allowances(categories, w.stage).total, step, single / step if step and single else None,
                  accumulation=peak - alone)


def block_seconds(plan: Plan, device: Device, micro_batch: int, num_layers: int) -> float | None:
    """One block's forward and backward at ``micro_batch`` on ``device`` at the assumed MFU (the step's FLOPs
    per token, head included, over the blocks: a little high); None without a device peak."""
    if not device.peak_tflops:
        return None
    tokens = micro_batch * plan.sequence_tokens
    return plan.flops_per_token * tokens / num_layers / (device.peak_tflops * 1e12 * plan.assumed_mfu)


def this_machine() -> str:
    """The kind (a key of ``DEVICES``) of this machine's GPU, by its name; cpu without a GPU or a listed name.
    Only for what a name tells (the dense peak): the memory to plan for is the device's own (``present.py``)."""
    if not torch.cuda.is_available():
        return "cpu"
    return kind_of(torch.cuda.get_device_name()) or "cpu"


def kind_of(gpu_name: str) -> str | None:
    """The key of ``DEVICES`` whose parts all occur in a ``torch.cuda.get_device_name()`` string, or None. A MIG
    slice or a GH200 matches the card it is part of or built like: its peak per SM, never its memory."""
    name = gpu_name.lower().replace(" ", "")
    # longest keys first: l40s before l4, a100_40gb (a100 and 40gb) before a100
    return next((key for key in sorted(DEVICES, key=len, reverse=True)
                 if all(part in name for part in key.split("_"))), None)
