"""data.micro_batch_size=auto: the largest micro batch whose traced step fits, grad_accum derived, one-line errors,
ranks agreeing, the dry run; and the trace shortcuts it relies on (depth scaling, representative chunks) are exact."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

import ddptrain.plan.memory.planner as memory_planner
import ddptrain.plan.memory.trace as memory_trace
from ddptrain.app.launch import agreed_micro_batch
from ddptrain.app.preflight import validate_config
from ddptrain.config.choices import ActivationCheckpointing
from ddptrain.config.compose import Run, build_config
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.plan.dry_run import plan_for_target
from ddptrain.plan.memory.auto_batch import (
    AUTO_MARGIN,
    StepNeed,
    choose_micro_batch,
    largest_fitting,
    planned_run,
    stages_weighed,
    state_exceeds,
    usable_bytes,
)
from ddptrain.plan.memory.overheads import RunOverheads, ranks_per_node
from ddptrain.plan.memory.planner import GiB, TracedStep, Tracer, target_device
from ddptrain.runtime.process_group import DistEnv
from tests.helpers.cli import run_cli
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import TINY_MODEL, TINY_RUN_ARGS, without
from tests.helpers.trace_cache import share_traces

VOCAB = 256
CPU = target_device("cpu", None, None)


@pytest.fixture(scope="module", autouse=True)
def shared_traces() -> Iterator[dict]:
    """The tests here search and check the same tiny steps (another global batch or device memory changes no
    trace): each distinct step is traced once for the module."""
    yield from share_traces()


def tiny_auto(global_batch: int = 12, **train: object) -> Config:
    return build_config({"model": {**TINY_MODEL, "vocab_size": VOCAB},
                         "data": {"seq_len": 32, "vocab_size": VOCAB, "global_batch_size": global_batch,
                                  "micro_batch_size": "auto"},
                         "train": {"loss_chunk_tokens": 16, **train}})


def full_trace(cfg: Config, micro_batch: int, per_rank: int,
               checkpointing: ActivationCheckpointing = ActivationCheckpointing.none,
               chunked_loss: bool | None = None) -> int:
    """The whole step traced, every block and every chunk (accumulating below the per-rank batch)."""
    accum = 2 if micro_batch < per_rank else 1
    with mock.patch.object(memory_trace, "representative_chunk_starts", memory_trace.ALL_CHUNK_STARTS):
        step = TracedStep(micro_batch, checkpointing, cfg.model.num_layers, accum, chunked_loss)
        return memory_planner.trace_peak(cfg, VOCAB, step, CPU).peak.peak


def device_between(low: float, high: float) -> object:
    """A CPU target whose usable memory (less auto's margin) lies between two needs."""
    return target_device("cpu", (low + high) / 2 / (1 - AUTO_MARGIN) / GiB, None)


# one test per mode (each case's traces are its own): the three together took 11 CPU s quiet and 18-24 under load
@pytest.mark.parametrize("checkpointing", list(ActivationCheckpointing), ids=str)
def test_depth_scaled_traces_on_representative_chunks_equal_the_whole_step_to_the_byte(
    checkpointing: ActivationCheckpointing,
) -> None:
    cfg = tiny_auto()
    cfg.model.num_layers = 3  # traced at one and two blocks, scaled to three
    tracer = Tracer(cfg, VOCAB, CPU)
    for micro_batch, accumulating in ((1, True), (5, True), (7, False)):
        exact = tracer.exact(micro_batch, checkpointing, accumulating=accumulating)
        whole = full_trace(cfg, micro_batch, 8 if accumulating else micro_batch, checkpointing)
        assert exact.peak == whole, (checkpointing, micro_batch, accumulating)


def test_auto_picks_the_largest_micro_batch_that_fits_and_derives_grad_accum_for_the_global_batch() -> None:
    cfg = tiny_auto(global_batch=12)
    need = {m: full_trace(cfg, m, 12) for m in (5, 6)}
    device = device_between(need[5], need[6])
    chosen = choose_micro_batch(cfg, 1, device, VOCAB)
    usable = device.memory_gib * GiB * (1 - AUTO_MARGIN)
    assert chosen.largest == 5 and need[5] <= usable < need[6]  # 5 fits, 6 does not
    assert chosen.need <= chosen.usable == usable
    # 5 does not divide the 12 sequences per rank: 4, with grad_accum 3, keeps the global batch
    assert (chosen.micro_batch, chosen.grad_accum) == (4, 3)
    assert "micro batch 4, grad_accum 3" in chosen.line() and "5 fits but does not divide" in chosen.line()


def step_need(tracer: Tracer, dp: int, per_rank: int) -> StepNeed:
    """The need ``choose_micro_batch`` weighs for the tracer's run and device on ``dp`` ranks, with the same
    allowances for the run's communicators and allocator (its default ``overheads``)."""
    cfg = tracer.cfg
    overheads = RunOverheads.of(cfg, ranks_per_node(cfg, dp), os.environ)
    return StepNeed(tracer, planned_run(cfg, dp, tracer.device), per_rank, overheads)


def test_the_whole_per_rank_batch_is_taken_only_when_its_exact_trace_fits() -> None:
    """The fit through micro batches 1-3 is a shortcut: with full checkpointing it under-estimates the whole batch
    of 14 here (by 3.8 kB), so a device between the fitted and the exact need must not get it."""
    cfg = tiny_auto(global_batch=14)
    cfg.model.activation_checkpointing = ActivationCheckpointing.full
    need = step_need(Tracer(cfg, VOCAB, CPU), 1, 14)
    fitted, exact = (need(14, ActivationCheckpointing.full, 0, fitted=f) for f in (True, False))
    assert fitted < exact
    chosen = choose_micro_batch(cfg, 1, device_between(fitted, exact), VOCAB)
    assert chosen.need <= chosen.usable and chosen.micro_batch < 14


def test_a_whole_batch_that_fits_without_accumulating_is_not_halved() -> None:
    """The whole per-rank batch in one micro batch needs less than the same micro batch as one of several
    (accumulation keeps more state): a device between the two takes it whole, grad_accum 1."""
    cfg = tiny_auto(global_batch=12)
    tracer = Tracer(cfg, VOCAB, CPU)
    whole, accumulating = (step_need(tracer, 1, per_rank)(12, ActivationCheckpointing.none, 0)
                           for per_rank in (12, 13))
    assert whole < accumulating
    chosen = choose_micro_batch(cfg, 1, device_between(whole, accumulating), VOCAB)
    assert (chosen.micro_batch, chosen.grad_accum) == (12, 1) and chosen.need == whole <= chosen.usable


def test_a_device_between_one_less_accumulating_and_the_whole_batch_does_not_get_the_whole_batch() -> None:
    """Here the whole per-rank batch (12, no accumulation) needs more than 11 accumulating: on a device between
    the two, 11 fits and 12 does not, so the search's answer (11, the largest below 12) must not be raised to 12
    (that takes ``fits(per_rank)``): micro batch 6 (the largest divisor of 12 up to 11), grad_accum 2."""
    cfg = tiny_auto(global_batch=12)
    need = step_need(Tracer(cfg, VOCAB, CPU), 1, 12)
    below, whole = need(11, ActivationCheckpointing.none, 0), need(12, ActivationCheckpointing.none, 0)
    assert below < whole
    chosen = choose_micro_batch(cfg, 1, device_between(below, whole), VOCAB)
    assert chosen.largest == 11 and chosen.micro_batch < 12 and (chosen.micro_batch, chosen.grad_accum) == (6, 2)
    assert chosen.need <= chosen.usable < whole


def test_a_per_rank_batch_of_one_weighs_micro_batch_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences on two ranks: micro batch 1 is the only choice, and auto weighs nothing else (no search below
    it: a trace of micro batch 0 is no step)."""
    import ddptrain.plan.memory.auto_batch as auto_batch

    asked: list[int] = []
    weigh = auto_batch.StepNeed.__call__

    def recording(self: StepNeed, micro_batch: int, *args: object, **kwargs: object) -> float:
        asked.append(micro_batch)
        return weigh(self, micro_batch, *args, **kwargs)

    monkeypatch.setattr(auto_batch.StepNeed, "__call__", recording)
    chosen = choose_micro_batch(tiny_auto(global_batch=2), 2, CPU, VOCAB)
    assert (chosen.micro_batch, chosen.grad_accum, chosen.largest) == (1, 1, 1)
    assert asked and set(asked) == {1}


def test_the_search_finds_the_boundary_from_any_guess() -> None:
    for boundary in (0, 1, 6, 17, 40):
        for guess in (1, 5, 16, 40):
            probes: list[int] = []

            def fits(m: int, boundary: int = boundary, probes: list[int] = probes) -> bool:
                probes.append(m)
                return m <= boundary

            assert largest_fitting(fits, 40, guess) == boundary
            assert len(probes) <= 14  # doubling then bisection, never a walk over every size


def test_the_aim_keeps_the_fits_guess_where_the_exact_need_at_it_is_no_higher_than_at_one() -> None:
    """Equal exact needs at micro batch 1 and at the fit's guess (a need that does not grow over that span) give
    no line to aim with: the guess stands, with no division by their zero difference; one that grows aims."""
    from ddptrain.plan.memory.auto_batch import aimed_guess

    assert aimed_guess(lambda m: 1000.0, 1300.0, 63, 17) == 17
    assert aimed_guess(lambda m: 1000.0 + 10.0 * m, 1300.0, 63, 17) == 30  # 1 + 290 * 16 / 160


def test_the_exact_search_aims_where_the_line_through_two_exact_needs_crosses_and_ends_where_any_guess_does() -> None:
    """A need near linear in the micro batch (as a traced step's), boundary 37 of 63, a fit that guessed 17: the
    line through the exact needs at 1 and 17 aims at 37, so the search verifies 37 and 38 and stops (two probes,
    four traces), where from 17 it took ten. Whatever the aim, the answer is the search's from any guess (a
    convex need, where the line aims long)."""
    from ddptrain.plan.memory.auto_batch import aimed_guess

    for need, aim in ((lambda m: 1000.0 + 10.0 * m, 37), (lambda m: 1000.0 + 0.5 * m * m, 63)):
        usable = need(37) + 0.1
        assert aimed_guess(need, usable, 63, 17) == aim
        probes: dict[int, list[int]] = {17: [], aim: []}
        for start, seen in probes.items():
            def fits(m: int, seen: list[int] = seen, need: Callable[[int], float] = need,
                     usable: float = usable) -> bool:
                seen.append(m)
                return need(m) <= usable

            assert largest_fitting(fits, 63, start) == 37
        assert len(probes[17]) == 10 and len(probes[aim]) == (2 if aim == 37 else 10)


@pytest.mark.parametrize("value", [0, -1, "big"])
def test_a_bad_micro_batch_size_is_a_one_line_error_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^data\.micro_batch_size=.*expected a positive number of sequences or auto"):
        build_config({"data": {"micro_batch_size": value}})


def test_auto_with_a_fixed_grad_accum_or_no_known_memory_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^data\.grad_accum=2: expected null with data\.micro_batch_size=auto"):
        build_config({"data": {"micro_batch_size": "auto", "grad_accum": 2}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine: no device memory to read
    with pytest.raises(ConfigError, match=r"^data\.micro_batch_size=auto needs .*plan\.device_memory_gib"):
        validate_config(tiny_auto(), 1)
    with pytest.raises(ConfigError, match=r"plan\.device_memory_gib"):  # the dry run on this CPU
        plan_for_target(tiny_auto(), 1)


def test_when_even_one_does_not_fit_the_error_names_what_would() -> None:
    cfg = tiny_auto(chunked_loss=False)
    cfg.model.num_layers = 4
    base = full_trace(cfg, 1, 12)
    remedies = {f"model.activation_checkpointing={mode}": full_trace(cfg, 1, 12, checkpointing=mode)
                for mode in (ActivationCheckpointing.selective, ActivationCheckpointing.full)}
    remedies["train.chunked_loss=true"] = full_trace(cfg, 1, 12, chunked_loss=True)
    assert all(need < base for need in remedies.values())
    lowest, second = sorted(remedies.values())[:2]
    assert lowest < second
    with pytest.raises(ConfigError) as caught:
        choose_micro_batch(cfg, 1, device_between(lowest, second), VOCAB)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("data.micro_batch_size=auto: even micro batch 1 needs")
    for remedy, need in remedies.items():  # the remedies that fit alone, and only those
        assert (remedy in line) == (need == lowest)
    state = planned_run(cfg, 1, CPU).memory[0].total  # below it, auto answers before tracing (tested below)
    with pytest.raises(ConfigError, match=r"nothing the planner weighs makes it fit .tried: "
                       r"model\.activation_checkpointing=selective"):
        choose_micro_batch(cfg, 1, device_between(state, lowest), VOCAB)


def test_where_no_remedy_fits_alone_the_line_names_those_that_fit_together() -> None:
    """``nothing_fits`` on a made-up need (GiB): 10 as configured, 9 with any one remedy, 5 with full checkpointing
    and the chunked loss at once, 6 usable: the line names the two that fit together (selective is not part of
    it: full recomputes more) with their need; where even that misses, it lists what was tried."""
    from ddptrain.plan.memory.auto_batch import nothing_fits

    cfg = tiny_auto(chunked_loss=False)

    def need(m: int, checkpointing: ActivationCheckpointing, stage: int, chunked_loss: bool | None = None) -> float:
        changed = (checkpointing != ActivationCheckpointing.none) + bool(chunked_loss)
        full_and_chunked = checkpointing == ActivationCheckpointing.full and chunked_loss
        return (5.0 if full_and_chunked else 9.0 if changed else 10.0) * GiB

    need.plan = SimpleNamespace(batch=SimpleNamespace(dp=1))  # type: ignore[attr-defined]  # one rank: no ZeRO stage
    device = target_device("cpu", 8.0, None)
    line = nothing_fits(cfg, need, 6.0 * GiB, device)  # type: ignore[arg-type]
    assert line.endswith("; it fits with model.activation_checkpointing=full and train.chunked_loss=true together "
                         "(5.00 GiB)"), line
    assert line.startswith("data.micro_batch_size=auto: even micro batch 1 needs 10.00 GiB per rank, over the 6.00")
    missed = nothing_fits(cfg, need, 4.0 * GiB, device)  # type: ignore[arg-type]
    assert "nothing the planner weighs makes it fit (tried: model.activation_checkpointing=selective (9.00 GiB), " \
           "model.activation_checkpointing=full (9.00 GiB), train.chunked_loss=true (9.00 GiB))" in missed


def test_the_dry_run_reports_the_chosen_micro_batch_and_plans_it() -> None:
    cfg = tiny_auto(global_batch=12)
    need = {m: full_trace(cfg, m, 12) for m in (6, 7)}
    cfg.plan.device_memory_gib = device_between(need[6], need[7]).memory_gib
    plan, text, record = plan_for_target(cfg, 1)
    assert "data.micro_batch_size=auto: micro batch 6, grad_accum 2" in text
    assert plan.batch.micro_batch_size == record["micro_batch_size"] == record["micro_batch_auto"]["micro_batch_size"]
    assert record["peak_bytes_per_rank"] == need[6]  # the configured step is the chosen one


def _agree(rank: int, world_size: int, memory_gib: list[float],
           search_alone: bool = True) -> tuple[int, dict, str, int]:
    """For ``run_distributed``: each rank resolves auto with its own device memory; what it ends with, and what
    it would have chosen alone (0: nothing fits; -1: not searched, ``search_alone=False``)."""
    cfg = tiny_auto(global_batch=24)
    cfg.plan.device_memory_gib = memory_gib[rank]
    alone = -1
    try:
        if search_alone:
            alone = choose_micro_batch(cfg, world_size, target_device("cpu", memory_gib[rank], None),
                                       VOCAB).micro_batch
    except ConfigError:
        alone = 0
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    try:
        typed, out = agreed_micro_batch(Run(None, cfg, resolved), env, torch.device("cpu"))  # type: ignore[arg-type]
    except ConfigError as exc:
        return 0, {}, str(exc), alone
    return typed.data.micro_batch_size, out["data"], "", alone


def test_a_rank_plans_with_its_own_nodes_ranks_and_takes_the_smallest_choice_by_a_min_all_reduce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, the search and the group stubbed (the slow test below runs both for real): rank 0 of 4, two per
    node, plans with its node's two ranks (``local_world_size``; the default would take plan.nodes' 1 node of 4,
    so another NVLS count), and agrees by an all-reduce with MIN: its 6 against a peer's 3 gives 3, written to the
    typed config and the resolved dict, with a line that says why."""
    import ddptrain.plan.memory.auto_batch as auto_batch

    cfg = tiny_auto(global_batch=24)
    env = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=2)
    planned: list[RunOverheads | None] = []

    def choose(typed: Config, world: int, target: object, vocab: int,
               overheads: RunOverheads | None = None) -> SimpleNamespace:
        planned.append(overheads)
        return SimpleNamespace(micro_batch=6, line=lambda: "data.micro_batch_size=auto: micro batch 6")

    ops: list[object] = []

    def all_reduce(tensor: torch.Tensor, op: object = torch.distributed.ReduceOp.SUM) -> None:
        ops.append(op)  # the group's answer with one peer that fits 3: MIN gives 3, SUM 9
        peer = torch.tensor([3])
        tensor.copy_(torch.minimum(tensor, peer) if op == torch.distributed.ReduceOp.MIN else tensor + peer)

    monkeypatch.setattr(auto_batch, "choose_micro_batch", choose)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    typed, out = agreed_micro_batch(Run(None, cfg, resolved), env, torch.device("cpu"))  # type: ignore[arg-type]
    assert planned == [RunOverheads.of(cfg, 2, os.environ)] and planned[0].ranks_per_node == 2
    assert RunOverheads.of(cfg, ranks_per_node(cfg, 4), os.environ).ranks_per_node == 4  # what the default plans
    assert ops == [torch.distributed.ReduceOp.MIN]
    assert (typed.data.micro_batch_size, out["data"]["micro_batch_size"], out["data"]["grad_accum"]) == (3, 3, None)


@pytest.mark.slow  # two 2-rank groups, each rank searching its choice: about 15 CPU seconds
def test_every_rank_takes_the_smallest_choice_and_all_stop_when_one_cannot_fit_any() -> None:
    cfg = tiny_auto(global_batch=24)
    need = {m: full_trace(cfg, m, 12) for m in (1, 2, 3, 12)}
    roomy, tight = (device_between(need[12], 2 * need[12]).memory_gib,
                    device_between(need[2], need[3]).memory_gib)
    results = run_distributed(_agree, 2, [roomy, tight])
    alone = [r[3] for r in results]
    assert alone[0] == 12 and 0 < alone[1] < 12  # alone, each rank would choose its own
    assert [r[0] for r in results] == [alone[1], alone[1]]
    assert all(r[1]["micro_batch_size"] == alone[1] and r[1]["grad_accum"] is None for r in results)
    state = planned_run(cfg, 2, CPU).memory[0].total
    failed = run_distributed(_agree, 2, [roomy, device_between(state, need[1]).memory_gib], False)  # state fits, 1 not
    assert [r[0] for r in failed] == [0, 0]
    assert failed[1][2].startswith("data.micro_batch_size=auto: even micro batch 1 needs")
    assert failed[0][2].startswith("data.micro_batch_size=auto: another rank cannot fit micro batch 1")


@pytest.mark.slow
def test_a_run_with_auto_logs_the_chosen_micro_batch_and_writes_it_to_config_yaml(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*without(TINY_RUN_ARGS, "data.micro_batch_size"), "data.micro_batch_size=auto",
            "plan.device_memory_gib=0.5", f"hydra.run.dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    logged = result.stdout + result.stderr
    found = re.search(r"data\.micro_batch_size=auto: micro batch (\d+), grad_accum (\d+)", logged)
    assert found, logged
    micro, accum = int(found[1]), int(found[2])
    assert f"global batch 2 = micro batch {micro} x grad accum {accum} x dp 1" in logged
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.data.micro_batch_size == micro and saved.data.grad_accum is None


STATE_CASES = {  # (config, ranks, target device): the early answer must never refuse what a trace would fit
    "fp32, 2 ranks (stages 0-3)": (lambda: tiny_auto(global_batch=24), 2, CPU),
    "bf16 on an H100, 2 ranks (stages 0-3)": (lambda: tiny_auto(global_batch=24), 2, target_device("h100", 1, None)),
    "LoRA, 2 ranks (stages 0-1)": (lambda: tiny_auto(global_batch=24), 2, CPU),
}


@pytest.mark.parametrize("case", STATE_CASES)
def test_a_traced_step_holds_at_least_the_model_state_the_early_answer_reads(case: str) -> None:
    """``auto`` refuses before tracing when the planner's model state alone exceeds the usable memory at every
    stage weighed; that is certain only if no traced step needs less than that state, whatever is weighed:
    checked at micro batch 1 with the least activations (full checkpointing and the chunked loss) at each stage."""
    make, dp, device = STATE_CASES[case]
    cfg = make()
    cfg.model.lora.enabled = case.startswith("LoRA")
    need = step_need(Tracer(cfg, VOCAB, device), dp, cfg.data.global_batch_size // dp)
    stages = stages_weighed(cfg, dp)
    assert len(stages) == (2 if cfg.model.lora.enabled else 4)
    for s in stages:
        assert need(1, ActivationCheckpointing.full, s, chunked_loss=True) >= need.plan.memory[s].total, s


def test_auto_refuses_at_once_when_the_model_state_alone_exceeds_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_auto(global_batch=24)
    plan = planned_run(cfg, 2, CPU)
    least = min(plan.memory[s].total for s in range(4))
    traced: list[object] = []
    monkeypatch.setattr(memory_planner, "trace_peak", lambda *a, **k: traced.append(a) or pytest.fail("traced"))
    below = target_device("cpu", least * 0.99 / (1 - AUTO_MARGIN) / GiB, None)
    with pytest.raises(ConfigError) as caught:
        choose_micro_batch(cfg, 2, below, VOCAB)
    assert str(caught.value).startswith(
        f"data.micro_batch_size=auto: the model state alone (parameters, gradients, optimizer state) needs "
        f"{least / GiB:.2f} GiB per rank (parallel.zero_stage=3, the least of stages 0-3 on 2 ranks)")
    assert not traced
    above = target_device("cpu", least * 1.01 / (1 - AUTO_MARGIN) / GiB, None)  # the traced answer decides
    assert state_exceeds(cfg, plan, usable_bytes(above), above) is None
    assert state_exceeds(cfg, plan, usable_bytes(below), below) == str(caught.value)
