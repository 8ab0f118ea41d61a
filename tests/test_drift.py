"""Replicas that drift apart (``train.drift_policy``): one element of one parameter changed on one rank
(``DDPTRAIN_FAULT=drift@step:S:R``) is caught at the next check on torch DDP, ZeRO-1 and HSDP (ZeRO-2 and ZeRO-3),
stops every rank with one line or is re-broadcast from the majority (each HSDP replica group from its own), and
changes nothing when nothing drifts; plain FSDP2 holds no replicas (nothing to compare). Checks fall every
train.check_every steps and on every logging and save step, with the three periods apart too. The fingerprint and
the verdict's wording, unit by unit."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ddptrain.train.drift as drift
from ddptrain.app.cli import run_cli as ddptrain_main
from ddptrain.config.choices import DriftPolicy
from ddptrain.errors import ConfigError
from ddptrain.parallel.fingerprint import WIDTH, Combined, combine, fingerprint
from ddptrain.parallel.replicas import ReplicaGroups
from ddptrain.testing.faults import step_hooks
from ddptrain.train.drift import DriftCheck, DriftError, Finding
from tests.helpers.cli import run_cli
from tests.helpers.dist import run_distributed
from tests.helpers.runs import FaultSpec, Overrides

# 4 steps, a check (and a logging step) every 2: a drift after step 3's update is seen at step 4's check
RUN: Overrides = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 128, "num_samples": 128, "seq_len": 16, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 2, "check_every": 2, "eval_every": 0},
    "optim": {"lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every_n_steps": 0},
}
OFF: Overrides = {"train": {"drift_policy": "off"}}
REBROADCAST: Overrides = {"train": {"drift_policy": "rebroadcast"}}
CHANGED = "model.norm.weight"  # the fault changes the last parameter a rank holds a part of: the final norm here
TWO_RANKS: list[tuple[str, Overrides, FaultSpec]] = [
    ("ddp-off", OFF, None),
    ("ddp", {}, None),
    ("ddp-drift", {"checkpoint": {"every_n_steps": 2}}, "drift@step:3:1"),
    ("ddp-rebroadcast", REBROADCAST, "drift@step:3:1"),
    # ZeRO-1's owners broadcast their parameters after every update: a drift lasts until the next update
    ("zero1-drift", {"parallel": {"zero_stage": 1}}, "drift@step:4:1"),
    ("zero1-healed", {"parallel": {"zero_stage": 1}}, "drift@step:3:1"),
    # FSDP2 over every rank: ZeRO-2 here reshards after backward, so it holds parameters as ZeRO-3 does
    ("zero2-drift", {"parallel": {"zero_stage": 2}}, "drift@step:3:1"),
    # check, logging and save periods apart: a check every step between logging steps (drift after step 2's
    # check: seen at step 2's, which follows it); a save at step 3, a step neither logs nor checks by period
    ("check-every-step", {"train": {"log_every": 4, "check_every": 1}}, "drift@step:2:1"),
    ("save-off-period", {"train": {"log_every": 4, "check_every": 4}, "checkpoint": {"every_n_steps": 3}},
     "drift@step:2:1"),
]
HSDP3: Overrides = {"parallel": {"zero_stage": 3, "shard_group": "node"}}
FOUR_RANKS: list[tuple[str, Overrides, FaultSpec]] = [  # 2 nodes x 2 ranks: ranks 0 and 2, 1 and 3 hold a shard
    ("hsdp-off", {**HSDP3, **OFF}, None),
    ("hsdp", HSDP3, None),
    ("hsdp3-drift", HSDP3, "drift@step:3:3"),
    ("hsdp2-drift", {"parallel": {"zero_stage": 2, "shard_group": "node"}}, "drift@step:3:2"),
    ("hsdp-rebroadcast", {**HSDP3, **REBROADCAST}, "drift@step:3:3"),
    # both replica groups drift at one check: each is repaired from its own group's majority
    ("hsdp-rebroadcast-both", {**HSDP3, **REBROADCAST}, {2: "drift@step:3:2", 3: "drift@step:3:3"}),
]


def _runs(rank: int, world_size: int, tmp: str, variants: list[tuple[str, Overrides, FaultSpec]],
          ranks_per_node: int) -> list[dict[str, Any]]:
    """``train_outcomes`` of each variant, with the parameters this rank holds at the end (an FSDP2 shard's local
    part) and the warnings the run logged."""
    import ddptrain.train.trainer as trainer
    from tests.helpers.runs import train_outcomes

    models: list[torch.nn.Module] = []
    build = trainer.build_model

    def keep(*args: Any, **kwargs: Any) -> torch.nn.Module:
        models.append(build(*args, **kwargs))
        return models[-1]

    trainer.build_model = keep
    warnings: list[str] = []

    class Warnings(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ddptrain").addHandler(Warnings(logging.WARNING))
    results = []
    for variant in variants:
        before = len(warnings)
        (result,) = train_outcomes(rank, world_size, tmp, RUN, [variant], False, ranks_per_node)
        from torch.distributed.tensor import DTensor

        held = [p.to_local() if isinstance(p, DTensor) else p for p in models[-1].parameters()]
        result["params"] = torch.cat([p.detach().flatten().clone() for p in held])
        result["warnings"] = warnings[before:]
        result["checkpoints"] = sorted(p.name for p in Path(result["dir"]).glob("checkpoints/step_*"))
        results.append(result)
    return results


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """name -> per rank: the outcome of each 2-rank variant."""
    ranks = run_distributed(_runs, 2, str(tmp_path_factory.mktemp("drift2")), TWO_RANKS, 2, timeout=600)
    return {name: [r[i] for r in ranks] for i, (name, _, _) in enumerate(TWO_RANKS)}


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """name -> per rank: the outcome of each variant on 4 ranks as 2 nodes of 2."""
    ranks = run_distributed(_runs, 4, str(tmp_path_factory.mktemp("drift4")), FOUR_RANKS, 2, timeout=600)
    return {name: [r[i] for r in ranks] for i, (name, _, _) in enumerate(FOUR_RANKS)}


def _line(step: int, differs: str, policy: str = "abort") -> str:
    return (f"replicas differ at step {step} (equal at step {step - 2}): {differs}, first in {CHANGED} "
            f"(train.drift_policy={policy}); no checkpoint was written after step {step - 2}")


def _unchanged(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> None:
    assert [m["loss"] for m in on[0]["metrics"]] == [m["loss"] for m in off[0]["metrics"]]
    assert len(on[0]["metrics"]) == 2 and all(r["error"] is None for r in on)
    assert all(torch.equal(a["params"], b["params"]) for a, b in zip(on, off, strict=True))


# one test per module fixture: the test that first asks for a fixture pays for its runs, and the 2- and 4-rank
# runs together went over the fast tier's budget on a loaded machine (gloo's waiting ranks spin)
def test_with_nothing_drifting_the_check_changes_no_loss_and_no_weight(two: dict) -> None:
    _unchanged(two["ddp"], two["ddp-off"])


def test_with_nothing_drifting_under_hsdp_the_check_changes_no_loss_and_no_weight(four: dict) -> None:
    _unchanged(four["hsdp"], four["hsdp-off"])


def test_a_drifted_ddp_replica_stops_every_rank_at_the_next_check_naming_it(two: dict) -> None:
    outcomes = two["ddp-drift"]
    assert [o["exit_code"] for o in outcomes] == [4, 4]
    assert [o["error"] for o in outcomes] == [_line(4, "rank 1 differs from rank 0")] * 2
    assert [o["checkpoints"] for o in outcomes] == [["step_000002"]] * 2  # the check came before step 4's save


def test_zero1_catches_a_drift_before_its_owners_broadcast_it_away(two: dict) -> None:
    """ZeRO-1's update ends with each owner broadcasting its parameters: a drift after a check step's update is
    caught there; one after another step's update is overwritten (or spread, on the owner) by the next update."""
    assert [o["error"] for o in two["zero1-drift"]] == [
        "replicas differ at step 4 (equal at step 2): rank 1 differs from rank 0, first in "
        f"{CHANGED} (train.drift_policy=abort); no checkpoint was written after step 2"] * 2
    healed = two["zero1-healed"]
    assert [o["error"] for o in healed] == [None, None] and torch.equal(healed[0]["params"], healed[1]["params"])


def test_fsdp2_over_every_rank_holds_no_replica_to_compare(two: dict) -> None:
    """ZeRO-2 (and ZeRO-3) over every rank hold each shard once: the changed shard is every rank's model, nothing
    differs, and the check must not compare shards with each other (they always differ)."""
    outcomes = two["zero2-drift"]
    assert [o["error"] for o in outcomes] == [None, None]
    assert outcomes[1]["warnings"] == [f"fault injection: changed {CHANGED} (its first element held here) after step 3"]


def test_under_hsdp_a_drifted_shard_is_named_within_its_replica_group(four: dict) -> None:
    assert [o["error"] for o in four["hsdp3-drift"]] == [_line(4, "rank 3 differs from rank 1")] * 4
    assert [o["error"] for o in four["hsdp2-drift"]] == [_line(4, "rank 2 differs from rank 0")] * 4
    assert all(o["exit_code"] == 4 for o in four["hsdp3-drift"] + four["hsdp2-drift"])


def test_rebroadcast_repairs_from_the_majority_warns_and_goes_on(two: dict, four: dict) -> None:
    ddp, hsdp = two["ddp-rebroadcast"], four["hsdp-rebroadcast"]
    assert all(o["error"] is None for o in ddp + hsdp) and len(ddp[0]["metrics"]) == len(hsdp[0]["metrics"]) == 2
    assert torch.equal(ddp[0]["params"], ddp[1]["params"])
    assert torch.equal(hsdp[1]["params"], hsdp[3]["params"]) and torch.equal(hsdp[0]["params"], hsdp[2]["params"])
    assert not torch.equal(ddp[0]["params"], two["ddp"][0]["params"])  # the drift did reach a gradient first
    for outcomes, differs, source in ((ddp, "rank 1 differs from rank 0", 0), (hsdp, "rank 3 differs from rank 1", 1)):
        for o in outcomes:
            assert (f"replicas differ at step 4 (equal at step 2): {differs}, first in {CHANGED}; re-broadcast "
                    f"1 parameter(s) from rank {source} (train.drift_policy=rebroadcast)") in o["warnings"], o


def test_a_check_every_step_between_logging_steps_catches_a_drift_at_its_own_step(two: dict) -> None:
    """train.check_every=1 under train.log_every=4: the drift after step 2's update is caught at step 2's check,
    which also names step 1's as the last that agreed (checks by log_every alone would catch it at step 4)."""
    assert [o["error"] for o in two["check-every-step"]] == [
        "replicas differ at step 2 (equal at step 1): rank 1 differs from rank 0, first in "
        f"{CHANGED} (train.drift_policy=abort); no checkpoint was written after step 1"] * 2


def test_a_save_off_the_logging_and_check_periods_checks_first_and_writes_no_drifted_checkpoint(two: dict) -> None:
    """checkpoint.every_n_steps=3 under logging and checks every 4: step 3 saves, so it checks before saving; the
    drift after step 2 stops every rank there, before anything is written."""
    outcomes = two["save-off-period"]
    assert [o["error"] for o in outcomes] == [
        "replicas differ at step 3 (the first check of this run): rank 1 differs from rank 0, first in "
        f"{CHANGED} (train.drift_policy=abort); no checkpoint was written by this run"] * 2
    assert [o["checkpoints"] for o in outcomes] == [[], []]


def test_rebroadcast_repairs_two_drifted_groups_at_one_check_each_from_its_own(four: dict) -> None:
    """Ranks 2 and 3 drift after step 3, one in each replica group ((0, 2) and (1, 3)): the check at step 4 repairs
    rank 2 from rank 0 and rank 3 from rank 1, within each group, and both groups' shards stay their own."""
    both = four["hsdp-rebroadcast-both"]
    assert all(o["error"] is None for o in both) and len(both[0]["metrics"]) == 2
    assert torch.equal(both[0]["params"], both[2]["params"]) and torch.equal(both[1]["params"], both[3]["params"])
    assert not torch.equal(both[0]["params"], both[1]["params"])  # the two shards, each group its own
    for o in both:
        assert (f"replicas differ at step 4 (equal at step 2): rank 2 differs from rank 0, first in {CHANGED}; "
                f"rank 3 differs from rank 1, first in {CHANGED}; re-broadcast 1 parameter(s) from rank 0, "
                "1 parameter(s) from rank 1 (train.drift_policy=rebroadcast)") in o["warnings"], o


def _reference(t: torch.Tensor) -> list[int]:
    """The fingerprint by its definition, one word at a time in Python integers modulo 2**64."""
    raw = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    total = positional = 0
    for i in range((len(raw) + 7) // 8):
        word = int.from_bytes(raw[8 * i:8 * i + 8].ljust(8, b"\0"), "little")
        total, positional = (total + word) % 2**64, (positional + word * (2 * i + 1)) % 2**64
    return [w - 2**64 if w >= 2**63 else w for w in (total, positional)]


@pytest.mark.parametrize(("numel", "dtype"), [(0, torch.float32), (3, torch.float32), (2 * WIDTH, torch.float32),
                                              (3 * WIDTH + 5, torch.float32), (7, torch.bfloat16),
                                              (1001, torch.float64), (13, torch.uint8)])
def test_the_fingerprint_is_its_definition_in_integers(numel: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel)
    t = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen) if dtype == torch.uint8 else \
        torch.randn(numel, generator=gen).to(dtype)
    assert fingerprint(t).tolist() == _reference(t)


def test_the_fingerprint_sees_one_changed_bit_and_two_swapped_elements_anywhere() -> None:
    t = torch.randn(2 * WIDTH + 3, generator=torch.Generator().manual_seed(0))
    base = fingerprint(t)
    assert fingerprint(t[5:105]).tolist() == _reference(t[5:105])  # a slice at an offset no word boundary starts
    for i in (0, 1, WIDTH - 1, WIDTH, 2 * WIDTH + 2):
        flipped = t.clone()
        flipped.view(torch.int32)[i] ^= 1  # the lowest mantissa bit: one ulp
        assert (fingerprint(flipped) != base).all(), i
    swapped = t.clone()
    swapped[[3, WIDTH + 7]] = swapped[[WIDTH + 7, 3]]
    assert fingerprint(swapped)[0] == base[0] and fingerprint(swapped)[1] != base[1]
    rows = torch.stack([base, fingerprint(t[:10])])
    assert not torch.equal(combine(rows), combine(rows.flip(0)))  # tensors in another order


def test_a_checks_combined_fingerprint_is_the_combination_of_each_tensors() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for n in (5, WIDTH * 2, 3 * WIDTH + 1)] + [
        torch.randn(1000, generator=gen).to(torch.bfloat16), torch.randn(33, generator=gen).double()[1:]]
    combined = Combined(tensors, torch.device("cpu"))
    assert torch.equal(combined(tensors), combine(torch.stack([fingerprint(t) for t in tensors])))
    changed = [t.clone() for t in tensors]
    changed[2][-1] += 1  # in the partial last row
    assert (combined(changed) != combined(tensors)).all()


def test_the_verdict_names_the_ranks_outside_the_majority_and_the_first_parameter_they_differ_in() -> None:
    same, other = [[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 9], [5, 7]]
    names = ["a", "b", "c"]
    three = Finding.of((0, 1, 2, 3), [same, same, other, same], names)
    assert (three.describe(), three.source, three.differing) == (
        "rank 2 differs from the majority (ranks 0, 1, 3), first in b", 0, [1, 2])
    pair = Finding.of((1, 3), [[], same, [], other], names)  # an HSDP group: rank 1 is the lower
    assert pair.describe() == "rank 3 differs from rank 1, first in b" and pair.source == 1
    tie = Finding.of((0, 1, 2, 3), [other, same, same, other], names)  # two against two: rank 0's side is kept
    assert tie.describe() == "ranks 1, 2 differ from the majority (ranks 0, 3), first in b"


def test_the_fingerprint_runs_on_the_tensors_own_device() -> None:
    """Every index and weight tensor is made where the parameters live (a CUDA run reads nothing back): on the meta
    device, a CPU tensor anywhere in the arithmetic is an error."""
    tensors = [torch.empty(n, device="meta") for n in (3, 2 * WIDTH, 3 * WIDTH + 5)]
    rows = torch.stack([fingerprint(t) for t in tensors])
    assert rows.device.type == combine(rows).device.type == "meta"
    assert Combined(tensors, torch.device("meta"))(tensors).device.type == "meta"


def test_the_start_up_line_says_what_the_replica_groups_compare() -> None:
    hsdp = ReplicaGroups(((0, 2), (1, 3)), 1, None, True)
    assert hsdp.comparable and hsdp.describe() == "each shard's 2 replicas across nodes: ranks (0, 2), (1, 3)"
    assert ReplicaGroups(((0, 1, 2),), 0, None, False).describe() == "whole replicas on 3 ranks"
    fsdp2 = ReplicaGroups((), 0, None, True)
    assert not fsdp2.comparable and fsdp2.describe() == (
        "nothing to compare: each parameter shard is held by one rank only (FSDP2 over every rank; "
        "parallel.shard_group=node replicates shards across nodes)")
    alone = ReplicaGroups(((0,),), 0, None, False)  # one rank holds each copy: nothing to compare
    assert not alone.comparable and alone.describe() == "nothing to compare"


def test_replica_groups_reads_hsdp_columns_and_refuses_parameters_on_two_placements_in_this_process() -> None:
    """``replica_groups`` on real DTensors of a one-rank (1, 1) mesh, in the test process (the 4-rank HSDP runs above
    reach it only in forked ranks): replicated along one dimension, one group per column; sharded only, nothing to
    compare; two placements in one model, a one-line error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ddptrain.parallel.replicas import replica_groups

    def placed(*placements: tuple[Any, ...]) -> torch.nn.Module:
        model = torch.nn.Linear(2, 2)
        for (name, param), placement in zip(list(model.named_parameters()), placements, strict=True):
            setattr(model, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, placement)))
        return model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        hsdp = (Replicate(), Shard(0))
        groups = replica_groups(placed(hsdp, hsdp))
        assert (groups.members, groups.slot, groups.sharded) == (((0,),), 0, True)
        assert groups.group is mesh.get_group(0) and not groups.comparable
        sharded = (Shard(0), Shard(0))
        assert replica_groups(placed(sharded, sharded)) == ReplicaGroups((), 0, None, True)
        with pytest.raises(ValueError) as caught:
            replica_groups(placed(hsdp, sharded))
        assert str(caught.value) == "the drift check expects every FSDP2 parameter on one mesh with one placement"
    finally:
        dist.destroy_process_group()


def _replicas(policy: DriftPolicy, start: int = 0) -> tuple[DriftCheck, torch.nn.Module, torch.nn.Module]:
    """This rank's check (rank 0 of a 2-rank replica group, built in-process: the group is given, not asked of a
    world) over a tiny model, and rank 1's copy of that model."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    check = DriftCheck(model, DriftPolicy.off, start)  # off: no world to ask for the groups
    check.policy, check.groups = policy, ReplicaGroups(((0, 1),), 0, None, False)
    check.combined = Combined([p.detach() for p in model.parameters()], torch.device("cpu"))
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    other.load_state_dict(model.state_dict())
    return check, model, other


def _settle(check: DriftCheck, other: torch.nn.Module, step: int) -> None:
    """The check's all-reduce (MAX) and gather of this rank's and rank 1's fingerprints, in-process."""
    rank1 = DriftCheck(other, DriftPolicy.off, 0)
    rank1.policy, rank1.groups = check.policy, check.groups
    rank1.combined = Combined([p.detach() for p in other.parameters()], torch.device("cpu"))
    agreed = torch.maximum(check.words(torch.device("cpu")), rank1.words(torch.device("cpu"))).tolist()
    rows = [torch.stack([fingerprint(p.detach()) for p in m.parameters()]).tolist() for m in (check.model, other)]
    check._gather = lambda _rows: rows  # type: ignore[method-assign]
    check.settle(agreed, step)


def test_a_check_names_the_last_agreeing_step_and_aborts_with_exit_4_when_replicas_differ() -> None:
    check, _, other = _replicas(DriftPolicy.abort)
    _settle(check, other, 2)
    assert check.agreed_at == 2
    with torch.no_grad():
        other[1].bias[1] += 1
    with pytest.raises(DriftError) as caught:
        _settle(check, other, 4)
    assert caught.value.exit_code == 4
    assert str(caught.value) == ("replicas differ at step 4 (equal at step 2): rank 1 differs from rank 0, first in "
                                 "1.bias (train.drift_policy=abort); no checkpoint was written after step 2")
    # no check agreed yet: in a fresh run, and in one resumed after step 6
    for start, since in ((0, "the first check of this run"), (6, "the first check since step 6")):
        fresh, _, drifted = _replicas(DriftPolicy.abort, start)
        with torch.no_grad():
            drifted[0].weight[0, 0] += 1
        with pytest.raises(DriftError, match=re.escape(
                f"({since}): rank 1 differs from rank 0, first in 0.weight (train.drift_policy=abort); "
                "no checkpoint was written by this run")):
            _settle(fresh, drifted, 7)


def test_rebroadcast_sends_only_the_differing_parameters_from_the_majority_and_counts_the_step_as_agreed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    check, model, other = _replicas(DriftPolicy.rebroadcast)
    sent: list[tuple[list[int], int, ReplicaGroups]] = []
    monkeypatch.setattr(drift, "rebroadcast", lambda tensors, source, groups: sent.append(
        ([t.data_ptr() for t in tensors], source, groups)))
    with torch.no_grad():
        other[0].bias[0] += 1
        other[1].weight[1] += 1
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        _settle(check, other, 4)
    assert sent == [([model[0].bias.data_ptr(), model[1].weight.data_ptr()], 0, check.groups)]
    assert caplog.messages == ["replicas differ at step 4 (the first check of this run): rank 1 differs from rank 0, "
                               "first in 0.bias; re-broadcast 2 parameter(s) from rank 0 "
                               "(train.drift_policy=rebroadcast)"]
    assert check.agreed_at == 4  # repaired: the next difference is counted from here


@pytest.mark.parametrize(("spec", "message"), [
    ("drift@step:3:1", None),
    ("bogus@step:3:1", "DDPTRAIN_FAULT=bogus@step:3:1: unknown fault kind 'bogus'; expected KIND@POINT:STEP[:RANK]"),
    ("drift@save:3:1", "DDPTRAIN_FAULT=drift@save:3:1: a drift fault strikes at step;"),
    ("kill@step", "DDPTRAIN_FAULT=kill@step: expected a step, a rank (or GROUP/RANK) after kill@step"),
    ("nan@step:x", "DDPTRAIN_FAULT=nan@step:x: expected a step, a rank (or GROUP/RANK) after nan@step"),
    ("delay@data:1:1:fast",
     "DDPTRAIN_FAULT=delay@data:1:1:fast: expected a step, a rank (or GROUP/RANK) and milliseconds"),
])
def test_a_fault_that_does_not_parse_is_a_one_line_error_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, spec: str, message: str | None
) -> None:
    monkeypatch.setenv("DDPTRAIN_FAULT", spec)
    for rank in (0, 1):  # the rank it names and another
        if message is None:
            step_hooks(rank)
            continue
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}") as caught:
            step_hooks(rank)
        assert "\n" not in str(caught.value)


def test_an_unknown_fault_kind_stops_the_run_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_FAULT", "drfit@step:1")
    code = ddptrain_main(["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "train.steps=1",
                          "data.seq_len=16", "data.global_batch_size=2", "data.micro_batch_size=2",
                          "logger.progress=false", "checkpoint.export=false", f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("ddptrain: error: DDPTRAIN_FAULT=drfit@step:1: unknown fault kind"), err


@pytest.mark.slow
def test_the_command_stops_a_drifted_replica_with_one_line_exit_4_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    args = ["launch.nproc_per_node=2", "data=synthetic", "model.num_layers=1", "model.hidden_size=32",
            "data.seq_len=16", "data.global_batch_size=4", "data.micro_batch_size=2", "train.steps=6",
            "train.log_every=3", "train.check_every=3", "train.eval_every=0", "checkpoint.every_n_steps=3",
            "logger.progress=false", f"hydra.run.dir={tmp_path}",
            "launch.max_restarts=1"]  # a restart left: the restarted workers end at once with 4 and say nothing
    result = run_cli(args, cwd=tmp_path, cache=tmp_path / "cache", extra_env={"DDPTRAIN_FAULT": "drift@step:4:1"})
    assert result.returncode == 4, result.stderr[-3000:]  # the workers' code, as docs/reliability.md promises
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("ddptrain: ")]
    assert lines == ["ddptrain: replicas differ at step 6 (equal at step 3): rank 1 differs from rank 0, first in "
                     f"{CHANGED} (train.drift_policy=abort); no checkpoint was written after step 3"], \
        result.stderr[-3000:]  # once (rank 0's), and no launcher line after it
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]
    assert "every check compares a fingerprint of the parameters: whole replicas on 2 ranks" in result.stderr
    # the stop and its restart both exited 4 (torch's agent logs each attempt's first failed worker)
    assert (tmp_path / "train.log").read_text().count("failed (exitcode: 4)") == 2


def test_each_hsdp_replica_group_is_read_from_its_own_slot_of_the_reduced_words() -> None:
    """2 nodes x 2 ranks, in-process: ranks 0 and 2 hold one shard, 1 and 3 another. Group 1's slot lies after group
    0's: when both agree nothing is gathered; when rank 3 drifts, it is named against rank 1."""
    shards = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    models = [torch.nn.Linear(3, 2) for _ in range(4)]
    for rank, model in enumerate(models):
        model.load_state_dict(shards[rank % 2].state_dict())
    checks = []
    for rank, model in enumerate(models):
        check = DriftCheck(model, DriftPolicy.off, 0)  # off: no world to ask for the groups
        check.policy, check.groups = DriftPolicy.abort, ReplicaGroups(((0, 2), (1, 3)), rank % 2, None, True)
        check.combined = Combined([p.detach() for p in model.parameters()], torch.device("cpu"))
        checks.append(check)
    gathered: list[int] = []

    def settle(step: int) -> None:
        agreed = torch.stack([c.words(torch.device("cpu")) for c in checks]).amax(0).tolist()
        table = [torch.stack([fingerprint(p.detach()) for p in m.parameters()]).tolist() for m in models]
        checks[0]._gather = lambda _rows: gathered.append(step) or table  # type: ignore[method-assign]
        checks[0].settle(agreed, step)

    settle(2)
    assert (checks[0].agreed_at, gathered) == (2, [])
    with torch.no_grad():
        models[3].bias[0] += 1
    with pytest.raises(DriftError, match=re.escape("replicas differ at step 4 (equal at step 2): rank 3 differs from "
                                                   "rank 1, first in bias (train.drift_policy=abort)")):
        settle(4)
    assert gathered == [4]


def test_local_parameters_are_the_plain_shards_this_rank_holds_of_fsdp2_parameters() -> None:
    """The fingerprint reads a tensor's own bytes: an FSDP2 parameter (a DTensor) is given as its local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ddptrain.parallel.replicas import local_parameters

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        held = list(local_parameters(model))
        assert [name for name, _ in held] == ["weight", "bias"]
        for (_, tensor), param in zip(held, model.parameters(), strict=True):
            assert isinstance(param, DTensor) and type(tensor) is torch.Tensor and not tensor.requires_grad
            assert tensor.data_ptr() == param.to_local().data_ptr()
    finally:
        dist.destroy_process_group()
