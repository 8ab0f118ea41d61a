"""Components own their state: the checkpoint manager saves parts registered by key on its own schedule, each part
gives and takes its own state dict through an unchanged ``trainer.pt``, the first step's work runs once, and
fault injection reaches the loop only as step hooks."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from ddptrain.checkpoint import CheckpointManager, TrainState
from ddptrain.config.choices import Precision
from ddptrain.errors import ConfigError
from ddptrain.runtime.hooks import StepHooks
from ddptrain.testing.faults import Fault, parse_fault, step_hooks

REPO = Path(__file__).parents[1]


class FakeCheckpointer:
    """Records what the manager saves; ``load`` hands back ``saved`` (a checkpoint found at ``found``)."""

    root = Path("checkpoints")

    def __init__(self, found: Path | None = None, saved: TrainState | None = None) -> None:
        self.found, self.saved = found, saved
        self.saves: list[tuple[int, bool, dict[str, Any]]] = []

    def save(self, state: TrainState, model: object, optimizer: object, wait: bool) -> None:
        self.saves.append((state.step, wait, state.record()))

    def remove_partial(self) -> None:
        pass

    def refuse_overwrite(self, target: str | None) -> None:
        pass

    def resolve(self, target: str | None) -> Path | None:
        return self.found if target else None

    def load(self, path: Path, model: object, optimizer: object) -> TrainState:
        assert self.saved is not None
        return self.saved


class Part:
    """A stateful part that counts what it gave and what it was given."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state, self.given = state, 0
        self.taken: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        self.given += 1
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken.append(state)


def _parts(scaler: bool = True) -> dict[str, Part]:
    parts = {"scheduler": Part({"last_epoch": 7}), "data": Part({"epoch": 1, "position": 48, "tokens_seen": 1536}),
             "run": Part({"world_size": 2, "global_batch_size": 16, "zero_stage": 1})}
    return {**parts, "grad_scaler": Part({"scale": 1024.0, "backoffs": 2})} if scaler else parts


def _manager(checkpointer: FakeCheckpointer, parts: dict[str, Part], every: int) -> CheckpointManager:
    return CheckpointManager(checkpointer, torch.nn.Linear(1, 1), None, parts, every)  # type: ignore[arg-type]


def test_the_manager_saves_every_n_steps_the_last_step_and_a_stop_and_waits_for_the_last_and_the_stop() -> None:
    checkpointer = FakeCheckpointer()
    manager = _manager(checkpointer, _parts(), every=3)
    saved = [manager.maybe_save(step, last=step == 8, stop=step == 4) for step in range(1, 9)]
    assert saved == [False, False, True, True, False, True, False, True]
    assert [(step, wait) for step, wait, _ in checkpointer.saves] == [(3, False), (4, True), (6, False), (8, True)]
    assert [manager.due(s) for s in (3, 4, 6)] == [True, False, True] and manager.due(5, last=True)
    only_last = FakeCheckpointer()
    never = _manager(only_last, _parts(), every=0)
    assert [never.maybe_save(step, last=step == 5) for step in range(1, 6)] == [False] * 4 + [True]
    assert [(step, wait) for step, wait, _ in only_last.saves] == [(5, True)]


def test_each_part_gives_its_own_state_into_trainer_pt_laid_out_as_before() -> None:
    checkpointer, parts = FakeCheckpointer(), _parts()
    _manager(checkpointer, parts, every=1).maybe_save(5)
    (_, _, record), = checkpointer.saves
    assert all(part.given == 1 for part in parts.values())
    # trainer.pt's fields, as format 2 has always written them
    assert record == {"step": 5, "scheduler": {"last_epoch": 7}, "epoch": 1, "samples_in_epoch": 48, "world_size": 2,
                      "global_batch_size": 16, "zero_stage": 1, "grad_scaler": {"scale": 1024.0, "backoffs": 2},
                      "stream": None, "tokens_seen": 1536}
    fp32 = FakeCheckpointer()
    _manager(fp32, _parts(scaler=False), every=1).maybe_save(5)
    assert fp32.saves[0][2]["grad_scaler"] is None
    # under DiLoCo the outer sync's state is one more field (and only then: earlier versions read the rest)
    with_outer = TrainState(**{**record, "outer_sync": {"since_sync": 2}})
    assert with_outer.record() == {**record, "outer_sync": {"since_sync": 2}}
    assert TrainState(**record).record() == record and "outer_sync" not in record


def test_resume_gives_each_part_its_own_state_and_an_empty_one_where_the_checkpoint_has_none() -> None:
    saved = TrainState(6, {"last_epoch": 6}, 2, 32, 4, 16, 0, grad_scaler=None, stream='[{"reader": 3}]',
                       tokens_seen=4096)
    parts = _parts()
    step = _manager(FakeCheckpointer(Path("step_000006"), saved), parts, every=1).resume("auto")
    assert step == 6
    assert parts["scheduler"].taken == [{"last_epoch": 6}]
    assert parts["data"].taken == [{"epoch": 2, "position": 32, "stream": '[{"reader": 3}]', "tokens_seen": 4096}]
    assert parts["run"].taken == [{"world_size": 4, "global_batch_size": 16, "zero_stage": 0}]
    assert parts["grad_scaler"].taken == [{}]  # not trained in fp16
    fresh = _parts()
    assert _manager(FakeCheckpointer(), fresh, every=1).resume(None) == 0
    assert all(not part.taken for part in fresh.values())


def test_the_loss_scaler_keeps_its_initial_scale_when_the_checkpoint_has_none(caplog: pytest.LogCaptureFixture) -> None:
    from ddptrain.train.loss_scale import LossScaler

    scaler = LossScaler(torch.device("cpu"), sharded=False)
    before = scaler.state_dict()
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == before
    assert "the checkpoint has no loss scale (not trained in fp16): starting from the initial scale" in caplog.text


def test_the_loss_scaler_checkpoints_its_scale_and_back_offs_and_logs_them() -> None:
    from ddptrain.train.loss_scale import LossScaler

    scaler = LossScaler(torch.device("cpu"), sharded=False)
    assert scaler.scale(torch.ones(())).item() == 2.0**16  # torch's initial scale, set at the first scale
    scaler.scaler.update(new_scale=1024.0)
    scaler.count_backoffs(2)
    scaler.count_backoffs(1)
    assert scaler.window() == {"loss_scale": 1024.0, "scaler_backoffs": 3}
    state = scaler.state_dict()
    assert state["backoffs"] == 3 and state["scale"] == 1024.0
    resumed = LossScaler(torch.device("cpu"), sharded=False)
    resumed.load_state_dict(state)
    assert resumed.window() == {"loss_scale": 1024.0, "scaler_backoffs": 3}
    assert state["backoffs"] == 3  # the checkpoint's state is read, not consumed


def test_the_first_steps_model_state_report_sets_each_ranks_bytes_beside_the_formula(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``report_model_state`` in-process, the gather given: ZeRO-3 over 2 ranks, 2**20 parameters of which 2**19
    train (adapters) and 2**18 are gathered at the peak; this is rank 1."""
    from ddptrain.plan.costs import MIXED_BF16
    from ddptrain.train import summary

    mib = 2**20
    held = [{"parameters": {"float32": 2 * mib}, "gradients": {"float32": mib}, "optimizer": {"float32": 2 * mib}},
            {"parameters": {"float32": 2 * mib, "bfloat16": mib // 2}, "gradients": {"float32": mib},
             "optimizer": {"float32": 2 * mib}}]
    monkeypatch.setattr(summary, "dist", SimpleNamespace(
        all_gather_object=lambda out, mine: out.__setitem__(slice(None), [held[0], mine]), get_rank=lambda: 1))
    probe = SimpleNamespace(bytes=held[1], gathered=2**18)
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        record = summary.report_model_state(probe, 2**20, 2, 3, 2, MIXED_BF16, trainable=2**19)
    # parameters: the fp32 shard (4 x 2**19) and the bf16 working copy of the gathered ones (2 x 2**18); gradients
    # and AdamW for the trainable half, sharded
    two_dtypes = "2.50 MiB [bfloat16 0.50, float32 2.00]"
    assert caplog.messages == [
        f"model state per rank (ZeRO-3, sharded over 2 of 2 ranks, {MIXED_BF16.name}): parameters {two_dtypes} "
        f"(formula {two_dtypes}), gradients 1.00 MiB (formula 1.00 MiB), optimizer 2.00 MiB (formula 2.00 MiB)"]
    assert record["formula_bytes"] == {"parameters": 2.5 * mib, "gradients": mib, "optimizer": 2 * mib}
    assert record["measured_bytes_per_rank"] == [
        {"parameters": 2 * mib, "gradients": mib, "optimizer": 2 * mib},
        {"parameters": 2.5 * mib, "gradients": mib, "optimizer": 2 * mib}]
    assert record["measured_bytes_by_dtype_per_rank"] == held
    assert (record["zero_stage"], record["shard_group_size"], record["precision"]) == (3, 2, MIXED_BF16.name)
    assert record["formula"] == ("4Ψ fp32 params + 4Ψ fp32 grads + 8Ψ AdamW, sharded per stage 3, + 2 bytes "
                                 "(bfloat16) per gathered parameter: 262144 parameters (root + largest block)")


def test_the_run_shape_part_warns_when_the_world_size_or_global_batch_changed(
        caplog: pytest.LogCaptureFixture) -> None:
    from ddptrain.config.compose import build_config
    from ddptrain.data import BatchShape
    from ddptrain.train.components import RunShape

    shape = BatchShape.from_config(build_config(), 2)
    part = RunShape(shape, 1)
    assert isinstance(part, Stateful)  # torch's protocol, which the manager's parts are typed as
    assert part.state_dict() == {"world_size": 2, "global_batch_size": shape.global_batch_size, "zero_stage": 1}
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        part.load_state_dict(part.state_dict())
        assert caplog.text == ""
        part.load_state_dict({"world_size": 4, "global_batch_size": 2 * shape.global_batch_size, "zero_stage": 0})
    assert f"resuming on 2 ranks from a checkpoint of 4: grad_accum {shape.grad_accum} keeps" in caplog.text
    assert f"the checkpoint trained with a global batch of {2 * shape.global_batch_size}; continuing" in caplog.text


def test_the_first_step_hook_acts_on_the_runs_first_step_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ddptrain.config.compose import build_config
    from ddptrain.plan.costs import FP32, MIXED_BF16
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.telemetry.comm import SyncSample
    from ddptrain.train import first_step

    calls: list[str] = []
    gathered: list[tuple] = []
    probe = SimpleNamespace(after_backward=lambda: calls.append("after_backward"),
                            after_step=lambda optimizer: calls.append("after_step"))
    monkeypatch.setattr(first_step, "report_model_state",
                        lambda *args: calls.append("gather") or gathered.append(args) or {"rank": 0})
    t = SimpleNamespace(start=10, probe=probe, optimizer=None, trainable=5, n_params=10, precision=Precision.fp32,
                        metrics=SimpleNamespace(restart_window=lambda: calls.append("restart_window")),
                        cfg=build_config({"train": {"compile": True}}), device=torch.device("cpu"),
                        env=DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1))
    first = first_step.FirstStep(t)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="ddptrain"):
        for step in range(11, 15):
            first.after_backward(step)
            first.after_step(step, None, log_step=step == 12)
    assert calls == ["after_backward", "restart_window", "after_step", "gather"]
    assert first.model_state == {"rank": 0} and first.compile_s is not None and first.compile_s >= 0
    assert caplog.messages[0].startswith("train.compile: first step ") and caplog.messages[0].endswith(
        " s, compilation included (kept out of throughput)")
    # the gather's arguments: the world, the stage, the ranks sharing one copy, the precision's bytes, trainable
    assert gathered == [(probe, 10, 1, 0, 1, FP32, 5)]
    # 4 ranks as 2 nodes of 2 under HSDP (ZeRO-3 over each node), bf16, no compile: nothing timed
    t.cfg = build_config({"parallel": {"zero_stage": 3, "shard_group": "node"}})
    t.env, t.precision, t.start = DistEnv(rank=1, local_rank=1, world_size=4, local_world_size=2), Precision.bf16, 0
    calls.clear()
    second = first_step.FirstStep(t)  # type: ignore[arg-type]
    second.after_step(1, SyncSample(100.0, None, None), log_step=False)
    assert gathered[-1] == (probe, 10, 4, 3, 2, MIXED_BF16, 5) and second.compile_s is None
    assert calls == ["after_step", "gather"]  # no compile: the window is not restarted


def test_fault_hooks_come_from_ddptrain_fault_for_their_rank_in_the_first_attempt_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPTRAIN_FAULT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert type(step_hooks(0)) is StepHooks
    monkeypatch.setenv("DDPTRAIN_FAULT", "nan@step:3:1")
    assert type(step_hooks(0)) is StepHooks
    fault = step_hooks(1)
    assert fault == Fault("nan", "step", 3) and [fault.poisons_loss(s) for s in (2, 3, 4)] == [False, True, False]
    monkeypatch.setenv("DDPTRAIN_FAULT", "delay@data:2:0:50")
    assert step_hooks(0) == Fault("delay", "data", 2, 50.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert type(step_hooks(0)) is StepHooks
    assert not StepHooks().poisons_loss(3)


def test_a_delay_fault_sleeps_inside_its_phase_from_its_step_on() -> None:
    phases: list[str] = []

    class Phase:
        def __init__(self, name: str) -> None:
            phases.append(name)

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    fault = Fault("delay", "forward", 2, 1.0)
    for step in (1, 2, 3):
        fault.step_started(step, Phase)
    assert phases == ["forward", "forward"]


def test_a_wait_fault_holds_its_step_in_the_data_phase_until_its_release_file_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("DDPTRAIN_FAULT_RELEASE", raising=False)
    monkeypatch.setenv("DDPTRAIN_FAULT", "wait@data:2:0")
    with pytest.raises(ConfigError, match="DDPTRAIN_FAULT=wait@data:2:0: a wait fault needs DDPTRAIN_FAULT_RELEASE"):
        step_hooks(0)
    # set but empty names no file: os.path.exists("") is never true, so such a wait would hold its rank forever
    monkeypatch.setenv("DDPTRAIN_FAULT_RELEASE", "")
    with pytest.raises(ConfigError, match="a wait fault needs DDPTRAIN_FAULT_RELEASE"):
        step_hooks(0)
    gates = tmp_path / "gates"
    gates.mkdir()
    monkeypatch.setenv("DDPTRAIN_FAULT_RELEASE", str(gates))
    fault = step_hooks(0)
    release = gates / "2"  # each step's gate is its own file in the folder
    assert fault == Fault("wait", "data", 2, 200.0, str(release))
    assert parse_fault("wait@data:10:1/0") == (Fault("wait", "data", 10, 200.0, str(gates / "10")), (1, 0))
    # the release is a wait's alone: another fault parsed beside it carries none
    assert parse_fault("delay@data:2:0:50") == (Fault("delay", "data", 2, 50.0), 0)
    with pytest.raises(ConfigError, match="a wait fault strikes at data"):
        parse_fault("wait@forward:2:0")
    phases: list[str] = []
    entered, left = threading.Event(), threading.Event()

    class Phase:
        def __init__(self, name: str) -> None:
            phases.append(name)

        def __enter__(self) -> None:
            entered.set()

        def __exit__(self, *exc: object) -> None:
            left.set()

    fault.step_started(1, Phase)  # not its step: no wait, no phase
    assert phases == []
    waiter = threading.Thread(target=fault.step_started, args=(2, Phase), daemon=True)
    waiter.start()
    assert entered.wait(60) and phases == ["data"]
    # held while the file is missing: counted polls, not a wall-clock bound (it waits however long that takes);
    # another step's gate opening does not open this one
    (gates / "1").touch()
    (gates / "20").touch()
    for _ in range(5):
        waiter.join(0.2)
        assert waiter.is_alive() and not left.is_set()
    release.touch()
    waiter.join(60)
    assert not waiter.is_alive() and left.is_set()
    fault.step_started(3, Phase)  # only its own step waits
    assert phases == ["data"]


def test_only_the_runs_build_names_fault_injection() -> None:
    """The loop and the checkpointer call step hooks; ``train/trainer.py`` alone builds them from faults."""
    users = set()
    for path in (REPO / "ddptrain").rglob("*.py"):
        if path.is_relative_to(REPO / "ddptrain" / "testing"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.startswith("ddptrain.testing") for n in named):
                users.add(path.relative_to(REPO).as_posix())
    assert users == {"ddptrain/train/trainer.py"}
