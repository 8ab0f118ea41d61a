"""Small rules of the memory planner that every plan passes through and no end-to-end figure isolates: which preset
a GPU's name is, how many NCCL communicators and NVLS groups a run holds per stage, what one step sends per stage,
and which traces the configured step takes (``ddptrain/plan/memory/planner.py``, ``overheads.py``)."""

from __future__ import annotations

from typing import Any

import pytest

import ddptrain.plan.dry_run as dry_run_module
import ddptrain.plan.memory.planner as memory_planner
from ddptrain.config.compose import build_config, compose_config, typed_config
from ddptrain.plan.analytic.planner import build_plan
from ddptrain.plan.costs import Comm
from ddptrain.plan.memory.overheads import RunOverheads
from ddptrain.plan.memory.present import device_for_plan
from ddptrain.plan.memory.trace import ACCUMULATING
from ddptrain.telemetry.storage_peak import CATEGORIES
from tests.helpers import fake_cuda
from tests.helpers.tiny import TINY_MODEL


@pytest.mark.parametrize(("name", "kind"), [
    (fake_cuda.H100.name, "h100"), (fake_cuda.H100_MIG_1G.name, "h100"),  # a MIG slice: the card it is part of
    (fake_cuda.GH200.name, "h200"),  # built like an H200
    (fake_cuda.A100.name, "a100"), ("NVIDIA A100-PCIE-40GB", "a100_40gb"),  # the longer key first
    (fake_cuda.L4.name, "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10", "a10"),
    (fake_cuda.RTX_4090.name, "rtx4090"),  # "RTX 4090" read without its space
    (fake_cuda.T4.name, "t4"), (fake_cuda.V100.name, "v100"),
    ("NVIDIA GeForce RTX 3090", None), ("cpu", None),
])
def test_a_gpus_name_as_torch_reports_it_is_its_preset(name: str, kind: str | None) -> None:
    assert memory_planner.kind_of(name) == kind


def test_communicators_and_nvls_groups_per_stage_follow_the_groups_the_run_holds() -> None:
    """Per ZeRO stage 0-3 on 16 ranks, 8 per node: DDP and ZeRO-1 one communicator (the default group); HSDP at
    stages 2-3 three (the default, shard and replicate groups), of which two span more than 2 GPUs of a node (the
    default and the shard group) and hold NVLS buffers. NCCL_NVLS_ENABLE=0, 2 GPUs per node or one rank: none."""
    plain = RunOverheads(ranks_per_node=8, hsdp=False, varying_shapes=False, expandable_segments=False)
    hsdp = RunOverheads(ranks_per_node=8, hsdp=True, varying_shapes=False, expandable_segments=False)
    assert [plain.communicators(s, 16) for s in range(4)] == [1, 1, 1, 1]
    assert [hsdp.communicators(s, 16) for s in range(4)] == [1, 1, 3, 3]
    assert [plain.nvls_groups(s, 16) for s in range(4)] == [1, 1, 1, 1]
    assert [hsdp.nvls_groups(s, 16) for s in range(4)] == [1, 1, 2, 2]
    off = RunOverheads(ranks_per_node=8, hsdp=True, varying_shapes=False, expandable_segments=False, nvls=False)
    pair = RunOverheads(ranks_per_node=2, hsdp=True, varying_shapes=False, expandable_segments=False)
    assert [off.nvls_groups(3, 16), pair.nvls_groups(3, 16), hsdp.nvls_groups(3, 1), hsdp.communicators(3, 1)] == [
        0, 0, 0, 0]
    assert hsdp.nvls_groups(3, 2) == 0  # a group of two ranks on one node: no NVLS, even with 8 per node
    # the allowance lines an H100 (an NVSwitch-class GPU) is charged at HSDP's stage 2
    lines = hsdp.items(2, 16, nvlink_sharp=True)
    assert any(line.startswith("NCCL: 3 communicators") for line in lines)
    assert any(line.startswith("NVLink SHARP buffers: 2 groups") for line in lines)


def test_each_stage_sends_what_a_ring_sends_per_rank_in_its_hops() -> None:
    """4 ranks, P trainable parameters, fp32 (4 bytes each): a ring all-reduce sends 2·(n-1)/n of the gradients
    in 2·(n-1) hops; ZeRO-1 then all-gathers the updated fp32 shards ((n-1)/n, n-1 hops); ZeRO-2 gathers the
    working copy once per micro batch and reduce-scatters the gradients once ((n-1)/n, n-1 hops each); ZeRO-3
    gathers twice (forward and backward)."""
    cfg = build_config({"model": dict(TINY_MODEL), "data": {"global_batch_size": 8, "micro_batch_size": 2},
                        "train": {"precision": "fp32"}})
    plan = build_plan(cfg, 4, "H100")
    share, p = 3 / 4 * plan.trainable, plan.precision
    none = Comm(0.0, 0)
    expected = {
        0: (none, Comm(2 * share * p.grad_bytes, 6), none),
        1: (none, Comm(2 * share * p.grad_bytes, 6), Comm(share * p.param_bytes, 3)),
        2: (Comm(share * p.gathered_bytes, 3), Comm(share * p.grad_bytes, 3), none),
        3: (Comm(2 * share * p.gathered_bytes, 6), Comm(share * p.grad_bytes, 3), none),
    }
    for stage, (gathers, sync, after) in expected.items():
        got = memory_planner.step_collectives(plan, stage)
        assert (got.gathers, got.sync, got.after) == (pytest.approx(gathers), pytest.approx(sync),
                                                     pytest.approx(after)), stage
    assert p.grad_bytes == p.param_bytes == 4


@pytest.mark.parametrize(("stage", "working_copies"), [(1, [False]), (2, [False, True]), (3, [False, True])])
def test_the_configured_step_is_traced_at_two_micro_batches_and_on_the_working_copy_from_stage_two(
        stage: int, working_copies: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Grad accumulation 4 under bf16 mixed precision on an H100: the configured step is traced with two micro
    batches (the second holds the first's gradients; more add nothing), and at ZeRO-2 and -3 once more on FSDP2's
    bf16 working copy, the trace the stage is sharded from."""
    cfg = build_config({"model": {**TINY_MODEL, "vocab_size": 256},
                        "data": {"seq_len": 32, "vocab_size": 256, "global_batch_size": 16, "micro_batch_size": 2},
                        "train": {"precision": "bf16", "loss_chunk_tokens": 16},
                        "parallel": {"zero_stage": stage}})
    plan = build_plan(cfg, 2, "H100")
    assert plan.batch.grad_accum == 4
    traced: list[tuple[int, bool]] = []
    trace = memory_planner.trace_peak

    def recording(cfg: Any, vocab: int, step: memory_planner.TracedStep, device: Any,
                  working_copy: bool = False) -> Any:
        traced.append((step.grad_accum, working_copy))
        return trace(cfg, vocab, step, device, working_copy)

    monkeypatch.setattr(memory_planner, "trace_peak", recording)
    single, stage_traced, _ = memory_planner.configured_peak(cfg, plan, 256, device_for_plan("h100", None, None))
    assert traced == [(2, copy) for copy in working_copies]
    assert (stage_traced is single) == (len(working_copies) == 1)


class ArithmeticTracer(memory_planner.Tracer):
    """A tracer whose steps are arithmetic, not traced (the test below: 0.3 CPU s): per block, 8 MiB of
    parameters and of gradients, 16 of optimizer state, 1 MiB of activations per sequence; the later micro batch
    of an accumulating step also holds temporaries growing with the square of the micro batch, which the fit
    through micro batches 1-3 (a line through 2 and 3) cannot follow, while every other phase is linear and
    the fit is exact there."""

    def phases(self, micro_batch: int, checkpointing: Any, num_layers: int, working_copy: bool = False,
               chunked_loss: bool | None = None) -> memory_planner.Phases:
        m, n, mib = micro_batch, num_layers, 2**20
        state = {c: 0 for c in CATEGORIES} | {"parameters": 8 * mib * n, "optimizer": 16 * mib * n}
        held = state | {"gradients": 8 * mib * n, "activations": mib * m * n}
        return {"forward": state | {"activations": mib * m * n}, "backward": held,
                "backward" + ACCUMULATING: held | {"temporaries": round(0.05 * mib * m * m * n)}}


def test_a_row_that_takes_the_whole_per_rank_batch_reports_its_fits_gap_without_accumulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run with ``data.micro_batch_size=auto`` on 2 ranks (16 sequences each): at ZeRO-0 the whole batch
    does not fit, so auto's search traced the fit and took micro batch 8, accumulating, where the fit misses the
    later micro batch's temporaries (a gap below 0). At ZeRO-1 to 3 the whole per-rank batch fits in one micro
    batch: that step does not accumulate, where the fit is exact, so its row's gap is 0 (weighed as if
    accumulating, it was the accumulating miss)."""
    monkeypatch.setattr(dry_run_module, "Tracer", ArithmeticTracer)
    cfg = typed_config(compose_config([
        "launch.dry_run=true", "plan.world_size=2", "data.global_batch_size=32", "data.micro_batch_size=auto",
        "data.seq_len=64", "plan.device=cpu", "plan.device_memory_gib=0.2"])).typed
    _, _, record = dry_run_module.plan_for_target(cfg, 2)
    assert record["micro_batch_auto"]["micro_batch_size"] == 8
    rows = {(o["zero_stage"], o["activation_checkpointing"]): o for o in record["options"]}
    assert (rows[0, "none"]["micro_batch_size"], record["fit_gap"]) == (8, rows[0, "none"]["fit_gap"])
    assert rows[0, "none"]["fit_gap"] < -0.01  # the fit misses an accumulating step
    whole = [rows[s, "none"] for s in (1, 2, 3)]
    assert [o["micro_batch_size"] for o in whole] == [16, 16, 16]
    assert [o["fit_gap"] for o in whole] == [pytest.approx(0.0, abs=1e-9)] * 3
