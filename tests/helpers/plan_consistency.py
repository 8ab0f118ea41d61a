"""One plan, one answer (issue 49): what the dry run prints and writes, checked against full traces of the same
settings taken by another path (``auto_batch.StepNeed``: the need ``data.micro_batch_size=auto`` weighs).

``dry_run`` runs the command's own planning in this process; ``assert_one_answer`` checks one dry run:

- each option row's micro batch fits by a full trace and the next larger divisor does not (the largest that fits);
- the by-checkpointing line's peaks are full traces too;
- each row equals what ``data.micro_batch_size=auto`` chooses for that stage and checkpointing mode (``with_auto``);
- a smaller micro batch plans no more than the next larger one, less what accumulating adds (shown in the row);
- the recommendation is the first option, and a dry run of its setting plans its bytes to 2 %;
- where a larger micro batch fits too, the recommendation's line says why, with the predicted step times;
- every printed figure (options, recommendation, auto's line, the by-checkpointing line) equals its plan.json field.

Traces are shared through ``tests/helpers/trace_cache.py``: the module using this holds ``share_traces``.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

from ddptrain.config.choices import ActivationCheckpointing
from ddptrain.config.compose import compose_config, typed_config
from ddptrain.config.schema import Config
from ddptrain.models.build import model_vocab_size
from ddptrain.plan.dry_run import plan_for_target
from ddptrain.plan.memory.auto_batch import StepNeed, choose_micro_batch, planned_run
from ddptrain.plan.memory.overheads import RunOverheads, ranks_per_node
from ddptrain.plan.memory.planner import (
    STAGE_NAMES,
    Device,
    GiB,
    Tracer,
    compute_dtype,
    divisors,
    shard,
    usable_bytes,
)
from ddptrain.plan.memory.present import device_for_plan


@dataclass(frozen=True)
class DryRun:
    """One dry run: its config (auto resolved as the dry run resolved it), what it printed and wrote."""

    cfg: Config
    world_size: int
    text: str
    record: dict

    @property
    def flat(self) -> str:
        """The printed text with runs of whitespace as one space (rich wraps long lines)."""
        return " ".join(self.text.split())


def dry_run(overrides: list[str]) -> DryRun:
    """``ddptrain launch.dry_run=true <overrides>``'s plan, in this process (what ``app.launch.dry_run`` prints
    and writes to plan.json)."""
    typed = typed_config(compose_config(["launch.dry_run=true", *overrides])).typed
    world_size = typed.launch.nproc_per_node
    _, text, record = plan_for_target(typed, world_size)
    cfg = copy.deepcopy(typed)
    if "micro_batch_auto" in record:
        cfg.data.micro_batch_size, cfg.data.grad_accum = record["micro_batch_auto"]["micro_batch_size"], None
    return DryRun(cfg, world_size, text, record)


def device_of(cfg: Config) -> Device:
    return device_for_plan(cfg.plan.device, cfg.plan.device_memory_gib, cfg.metrics.peak_tflops)


def step_need(cfg: Config, world_size: int) -> StepNeed:
    """Full traces of ``cfg``'s steps as auto weighs them (depth-scaled, sharded, allowances included)."""
    device, dp = device_of(cfg), cfg.plan.world_size or world_size
    vocab = model_vocab_size(cfg.model, cfg.data.vocab_size)
    return StepNeed(Tracer(cfg, vocab, device), planned_run(cfg, dp, device), cfg.data.global_batch_size // dp,
                    RunOverheads.of(cfg, ranks_per_node(cfg, dp), os.environ))


def option_key(option: dict) -> str:
    return f"{STAGE_NAMES[option['zero_stage']]}/{option['activation_checkpointing']}"


def assert_rows_are_the_largest_that_fit(run: DryRun) -> None:
    need = step_need(run.cfg, run.world_size)
    usable = usable_bytes(device_of(run.cfg))
    per_rank = need.per_rank
    assert run.record["options"], "no option fits"
    for o in run.record["options"]:
        m, mode, stage = o["micro_batch_size"], ActivationCheckpointing(o["activation_checkpointing"]), o["zero_stage"]
        larger = [d for d in divisors(per_rank) if d > m]
        for d in larger:  # none of the larger divisors fits: the row is the largest
            there = need(d, mode, stage)
            assert there > usable, (f"{option_key(o)}: micro batch {d} fits by a full trace ({there / GiB:.2f} of "
                                    f"{usable / GiB:.2f} GiB) but the row says {m}")
        here = need(m, mode, stage)
        assert here <= usable, f"{option_key(o)}: micro batch {m} needs {here / GiB:.2f} GiB by a full trace, over " \
                               f"the {usable / GiB:.2f} GiB usable"
        assert abs(o["total_bytes_per_rank"] - here) <= 1, f"{option_key(o)}: the row is not its full trace"
        if larger:  # a smaller micro batch plans no more than a larger one, but for what accumulating adds
            assert here - o["accumulation_bytes"] <= need(larger[0], mode, stage)
    assert run.record["usable_bytes_per_rank"] == round(usable)  # the memory auto chooses against


def assert_by_checkpointing_is_full_traces(run: DryRun) -> None:
    """The by-checkpointing line: each mode's peak per rank at the configured micro batch and stage is its full
    trace, sharded (no fit of small traces)."""
    cfg, need = run.cfg, step_need(run.cfg, run.world_size)
    plan, stage, accumulating = need.plan, cfg.parallel.zero_stage, cfg.data.micro_batch_size < need.per_rank
    dtype = compute_dtype(cfg.train.precision, need.tracer.device)
    working_copy = dtype is not None and plan.precision.gathered_bytes < plan.precision.param_bytes and stage >= 2
    for mode, by in run.record["by_checkpointing"].items():
        traced = need.tracer.exact(cfg.data.micro_batch_size, ActivationCheckpointing(mode), working_copy, accumulating)
        planned = shard(traced.by_category, stage, plan.batch.dp, plan, accumulating)
        assert abs(by["peak_bytes_per_rank"] - sum(planned.values())) <= 1, mode


def assert_rows_equal_auto(run: DryRun, only: tuple[int, ActivationCheckpointing] | None = None) -> None:
    """Each row (or ``only`` the row of that stage and mode) is auto's choice for its stage and mode."""
    for o in run.record["options"]:
        mode, stage = ActivationCheckpointing(o["activation_checkpointing"]), o["zero_stage"]
        if only is not None and (stage, mode) != only:
            continue
        cfg = copy.deepcopy(run.cfg)
        cfg.parallel.zero_stage, cfg.model.activation_checkpointing = stage, mode
        dp = cfg.plan.world_size or run.world_size
        auto = choose_micro_batch(cfg, dp, device_of(cfg), model_vocab_size(cfg.model, cfg.data.vocab_size))
        assert auto.micro_batch == o["micro_batch_size"], \
            f"{option_key(o)}: auto chooses {auto.micro_batch}, the row says {o['micro_batch_size']}"


def assert_recommendation_is_one_answer(run: DryRun) -> None:
    record, flat = run.record, run.flat
    best = record["recommendation"]
    assert best == record["options"][0]
    line = re.search(r"Recommendation: (.*?)\.(?: Host:|$)", flat)
    assert line is not None, flat[-500:]
    said = line.group(1)
    assert said.startswith(f"micro batch {best['micro_batch_size']} (grad_accum {best['grad_accum']}), checkpointing "
                           f"{best['activation_checkpointing']}, {STAGE_NAMES[best['zero_stage']]}: fits "
                           f"({best['total_bytes_per_rank'] / GiB:,.1f} of "), said
    larger = [o for o in record["options"] if o["micro_batch_size"] > best["micro_batch_size"]]
    if larger:  # it says why, in the same line
        note = record["recommendation_note"]
        assert note is not None and f"; {note}" in said
        biggest = max(o["micro_batch_size"] for o in larger)
        assert f"micro batch {biggest} " in note
        if best["predicted_step_s"] is not None:
            assert f"{best['predicted_step_s'] * 1e3:,.1f} ms" in note
    else:
        assert record["recommendation_note"] is None


def assert_recommended_setting_plans_the_same(run: DryRun) -> None:
    """A dry run of the recommended setting plans the recommendation's bytes per rank (to 2 %)."""
    best = run.record["recommendation"]
    cfg = copy.deepcopy(run.cfg)
    cfg.data.micro_batch_size, cfg.data.grad_accum = best["micro_batch_size"], None
    cfg.parallel.zero_stage = best["zero_stage"]
    cfg.model.activation_checkpointing = ActivationCheckpointing(best["activation_checkpointing"])
    _, _, again = plan_for_target(cfg, run.world_size)
    assert abs(again["total_bytes_per_rank"] / best["total_bytes_per_rank"] - 1) <= 0.02, \
        (again["total_bytes_per_rank"], best["total_bytes_per_rank"])


def assert_printed_equals_written(run: DryRun) -> None:
    record, flat = run.record, run.flat
    usable = record["usable_bytes_per_rank"]
    for o in record["options"]:
        held = f" (+{o['accumulation_bytes'] / GiB:,.2f} GiB)" if o["accumulation_bytes"] > 0 else ""
        cells = [STAGE_NAMES[o["zero_stage"]], o["activation_checkpointing"], str(o["micro_batch_size"]),
                 f"{o['grad_accum']}{held}", f"{o['total_bytes_per_rank'] / GiB:,.1f} of {usable / GiB:,.1f} GiB"]
        row = r"│\s*" + r"\s*│\s*".join(re.escape(c) for c in cells) + r"\s*│"
        assert re.search(row, run.text), f"no printed row {cells}"
    for mode, by in record["by_checkpointing"].items():
        assert (f"{mode}: {by['activations_bytes'] / GiB:,.2f} GiB (peak {by['peak_bytes_per_rank'] / GiB:,.2f} GiB)"
                in flat), mode
    assert f"{record['total_bytes_per_rank'] / GiB:,.2f} GiB: " in flat
    if "micro_batch_auto" in record:
        auto = record["micro_batch_auto"]
        assert (f"data.micro_batch_size=auto: micro batch {auto['micro_batch_size']}, grad_accum {auto['grad_accum']} "
                f"({auto['need_bytes_per_rank'] / GiB:.2f} of {auto['usable_bytes_per_rank'] / GiB:.2f} GiB") in flat
        assert round(auto["usable_bytes_per_rank"]) == usable


def assert_one_answer(run: DryRun) -> None:
    """Every check above on one dry run (auto against the configured stage and mode's row only: ``with_auto`` in
    the matrix weighs every row)."""
    assert_rows_are_the_largest_that_fit(run)
    assert_by_checkpointing_is_full_traces(run)
    assert_recommendation_is_one_answer(run)
    assert_printed_equals_written(run)
    assert_recommended_setting_plans_the_same(run)
