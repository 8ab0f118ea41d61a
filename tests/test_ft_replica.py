"""A replica group's side of each step (ddptrain/ft/replica.py) against a scripted torchft Manager: the quorum's
step, a heal from a peer, a step not committed (its data given back), the quorum sizes per step, the average across
groups, and DiLoCo's quorum at the window's sync and its resume. The real groups run in tests/test_ft_cli.py and
tests/test_diloco_cli.py (slow): these check, in a second, what those runs only show as a final loss."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from ddptrain.config.schema import Config
from ddptrain.ft.accounting import quorum_runs
from ddptrain.ft.layout import events_path
from ddptrain.ft.replica import ReplicaGroup
from ddptrain.runtime.process_group import DistEnv


class Data:
    """The data position: samples of the global order consumed."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Done:
    """A finished all-reduce, as torchft's Work answers it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.future.set_result(tensor)

    def wait(self, timeout: object = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self.future


class ScriptedManager:
    """torchft's Manager as the groups would drive it: ``commits`` answers should_commit in turn; ``heal`` (the
    peers' step and their state) is applied at the next quorum, through the load function the group gave; the
    all-reduce averages with one peer whose tensor is all zeros."""

    def __init__(self, *, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any], **_: Any) -> None:
        self._use_async_quorum = False
        self.load, self.save = load_state_dict, state_dict
        self.step, self.participants = 0, 2
        self.commits: list[bool] = []
        self.heal: tuple[int, dict[str, Any]] | None = None

    def start_quorum(self) -> None:
        if self.heal is not None:
            (self.step, state), self.heal = self.heal, None
            self.load(state)

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def should_commit(self) -> bool:
        ok = self.commits.pop(0) if self.commits else True
        self.step += ok
        return ok

    def allreduce(self, tensor: torch.Tensor, **_: Any) -> Done:
        tensor.div_(2)  # (this group's + a peer's zeros) / 2
        return Done(tensor)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]

    def register_state_dict_fn(self, *_: Any) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch, compose: Callable[..., Config], tmp_path: Path
          ) -> Callable[..., ReplicaGroup]:
    import torchft
    import torchft.checkpointing.pg_transport as transport

    monkeypatch.setattr(torchft, "Manager", ScriptedManager)
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda **_: None)
    monkeypatch.setattr(transport, "PGTransport", lambda *_, **__: None)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    def build(*overrides: str, model: torch.nn.Module | None = None) -> ReplicaGroup:
        cfg = compose("ft.replica_groups=2", "ft.replica_id=1", *overrides)
        model = model if model is not None else torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        parts = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "data": Data()}
        return ReplicaGroup(cfg, DistEnv(0, 0, 1, 1), tmp_path / "group1", parts)

    return build


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in events_path(tmp_path, 1).read_text().splitlines()]


def test_a_step_not_committed_gives_its_data_back_and_a_heal_jumps_to_the_peers_next_step(
        group: Callable[..., ReplicaGroup], tmp_path: Path) -> None:
    rg = group()
    manager, data = rg.manager, rg.parts["data"]
    assert isinstance(manager, ScriptedManager) and isinstance(data, Data)
    rg.resumed(0)
    manager.commits = [True, False, True, True, False, True]

    def step(asked: int, participants: int = 2) -> tuple[int, bool]:
        taken = rg.begin(asked)
        data.position += 4  # the step draws its batch
        manager.participants = participants
        return taken, rg.commit(taken)

    assert step(1) == (1, True) and data.position == 4
    assert step(2) == (2, False) and data.position == 4  # not committed: the batch goes back, the step comes again
    assert step(3) == (2, True) and data.position == 8  # asked for 3, the quorum's step is still 2
    assert step(3, participants=3) == (3, True)
    peer = rg._state() | {"data": {"position": 40}}
    manager.heal = (5, peer)  # a peer is after step 5: this group copies its state at the quorum
    assert step(4, participants=3) == (6, False) and data.position == 40  # given back to the healed position
    assert rg.heal_seconds > 0
    assert step(7, participants=3) == (6, True) and data.position == 44
    assert rg.summary()["ft"]["quorum_per_step"] == [[1, 2, 2], [3, 3, 3], [6, 6, 3]]
    assert rg.window() == {"ft_quorum_min": 2, "ft_quorum_mean": 2.5}  # committed: 2, 2, 3, 3
    events = _events(tmp_path)
    assert [e for e in events if e["event"] == "heal"] == [{"event": "heal", "step": 6,
                                                             "seconds": events[-3]["seconds"]}]
    assert [(e["step"], e["committed"]) for e in events if e["event"] == "step"] == [
        (1, True), (2, False), (2, True), (3, True), (6, False), (6, True)]


def test_the_average_across_groups_carries_the_loss_and_its_bytes_join_comm_bytes(
        group: Callable[..., ReplicaGroup]) -> None:
    rg = group()
    model = rg.parts["model"]
    assert isinstance(model, torch.nn.Module)
    loss = model(torch.ones(4, 3)).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    averaged = rg.average(model, loss.detach())
    assert averaged.item() == pytest.approx(loss.item() / 2)  # the mean with the peer's, not this group's own
    assert all(torch.equal(p.grad, g / 2) for p, g in zip(model.parameters(), grads, strict=True))
    payload = sum(g.numel() * 4 for g in grads)  # every parameter's fp32 gradient (6 + 2 + 2 + 1 floats)
    assert rg.summarize({"comm_bytes": 100.0})["comm_bytes"] == 100.0 + payload


def test_diloco_records_a_quorum_only_at_a_sync_and_a_resume_keeps_the_managers_count_of_syncs(
        group: Callable[..., ReplicaGroup], tmp_path: Path) -> None:
    rg = group("ft.sync=diloco", "ft.sync_every=2")
    opt = rg.parts["optimizer"]
    assert isinstance(opt, torch.optim.Optimizer) and rg.outer is not None
    rg.resumed(0)
    for step in range(1, 5):
        assert rg.begin(step) == step and rg.commit(step)
        opt.step()  # the window's sync runs in its hooks at steps 2 and 4
        rg.updated(step)
    assert [(e["step"], e["quorum"]) for e in _events(tmp_path) if e["event"] == "step"] == [
        (1, None), (2, 2), (3, None), (4, 2)]
    assert rg.summary()["ft"]["quorum_per_step"] == [[2, 2, 2], [4, 4, 2]]
    assert rg.manager.current_step() == 2  # DiLoCo's manager counts the syncs, not the inner steps
    saved = rg.outer.state_dict()
    rg.close()

    again = group("ft.sync=diloco", "ft.sync_every=2")
    assert again.outer is not None
    again.outer.load_state_dict(saved)  # the checkpoint's part, then the trainer's resumed(its step)
    again.resumed(4)
    assert again.manager.current_step() == 2


def test_ft_json_keeps_steps_apart_that_are_not_consecutive_and_leaves_out_steps_never_committed() -> None:
    def step(s: int, quorum: int | None, committed: bool = True) -> dict[str, Any]:
        return {"event": "step", "step": s, "quorum": quorum, "committed": committed}

    diloco = [step(s, 2 if s % 4 == 0 else None) for s in range(1, 9)]  # a sync closes steps 4 and 8
    assert quorum_runs([diloco]) == [[4, 4, 2], [8, 8, 2]]
    from ddptrain.ft.accounting import group_record

    killed = [step(1, 2), step(2, 2, committed=False)]  # died in step 2: never committed by this group
    assert group_record(0, killed)["steps"] == [[1, 1]]


def test_diloco_outer_state_rides_in_the_checkpoints_train_state(group: Callable[..., ReplicaGroup]) -> None:
    from ddptrain.checkpoint.format import TrainState

    rg = group("ft.sync=diloco", "ft.sync_every=2")
    assert rg.stateful() == {"outer_sync": rg.outer} and group().stateful() == {}
    outer = {"since_sync": 1, "manager": {"step": 3, "batches_committed": 0}}
    parts = {"scheduler": {"last_epoch": 5}, "data": {"epoch": 0, "position": 20},
             "run": {"world_size": 1, "global_batch_size": 4, "zero_stage": 0}, "outer_sync": outer}
    state = TrainState.from_parts(5, parts)
    assert state.outer_sync == outer and state.parts()["outer_sync"] == outer


class _Scripted:
    """The trainer's replica side, scripted (the loop's contract with ft/replica.py): step 2 is not committed the
    first time; asked for step 4, the group heals (0.5 s) and rejoins at step 5. Records what the loop did."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts, self.heal_seconds = parts, 0.0
        self.begun: list[tuple[int, float]] = []  # (step, the learning rate it trains with)
        self.updated_params: list[bool] = []  # whether each step's update changed the model
        self._before: list[torch.Tensor] = []
        self._refused = False

    def begin(self, step: int) -> int:
        if self.begun and self.begun[-1][0] == 2 and len(self.begun) == 2:
            step = 2  # the step not committed comes again
        self.heal_seconds = 0.5 if step == 4 else 0.0
        step = 5 if step == 4 else step
        self.begun.append((step, self.parts["scheduler"].get_last_lr()[0]))
        return step

    def average(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def commit(self, step: int) -> bool:
        self._before = [p.detach().clone() for p in self.parts["model"].parameters()]
        if step == 2 and not self._refused:
            self._refused = True
            return False
        return True

    def updated(self, step: int) -> None:
        after = list(self.parts["model"].parameters())
        self.updated_params.append(any(not torch.equal(a, b) for a, b in zip(after, self._before, strict=True)))

    def window(self) -> dict[str, Any]:
        return {}

    def summarize(self, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def stateful(self) -> dict[str, Any]:
        return {}

    def resumed(self, start: int) -> None:
        pass

    def close(self) -> None:
        pass


def _train_scripted(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import ddptrain.train.trainer as trainer_module
    from ddptrain.train.trainer import Trainer
    from tests.helpers.runs import make_config

    scripted: list[_Scripted] = []

    def replicas_for(cfg: Config, env: DistEnv, run_dir: Path, parts: dict[str, Any]) -> _Scripted:
        scripted.append(_Scripted(parts))
        return scripted[0]

    trainer_module.replicas_for = replicas_for  # this spawned rank's own module
    cfg = make_config(tmp, {
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
        "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 16, "global_batch_size": 4,
                 "micro_batch_size": 2},
        "train": {"steps": 6, "log_every": 3, "eval_every": 0},
        "optim": {"warmup_steps": 10},  # the learning rate changes every step
        "ft": {"replica_groups": 2, "replica_id": 1}})
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    trainer = Trainer(cfg, env, torch.device("cpu"), Path(tmp), {})
    sampler_rank = trainer.batches.sampler.rank
    summary = trainer.train()
    (attempt,) = json.loads((Path(tmp) / "goodput.json").read_text())["attempts"]
    return {"begun": scripted[0].begun, "updated": scripted[0].updated_params, "sampler_rank": sampler_rank,
            "dp": trainer.shape.dp, "recovery_s": summary["goodput"]["recovery_s"],
            "attempt_steps": (attempt["resumed_from"], attempt["last_step"])}


def test_the_loop_takes_a_step_not_committed_again_unapplied_and_books_a_heal_as_recovery(tmp_path: Path) -> None:
    from tests.helpers.dist import run_distributed

    (run,) = run_distributed(_train_scripted, 1, str(tmp_path))
    assert run["dp"] == 2 and run["sampler_rank"] == 1  # group 1's only rank: the second share of the batch
    steps = [s for s, _ in run["begun"]]
    assert steps == [1, 2, 2, 3, 5, 6]
    lrs = [lr for _, lr in run["begun"]]
    assert lrs[1] == lrs[2] and lrs[0] < lrs[1] < lrs[3]  # the schedule did not step on the refused step
    assert run["updated"] == [True, False, True, True, True, True]  # its update was not applied
    assert run["recovery_s"] == pytest.approx(0.5, abs=1e-6)
    # goodput.json: the heal brought this attempt to the peers' step 4, and it continued after it to step 6
    assert run["attempt_steps"] == (4, 6)


def test_no_quorum_in_time_ends_the_group_as_a_quorum_loss_recorded_in_its_events(
        group: Callable[..., ReplicaGroup], tmp_path: Path) -> None:
    """The lighthouse's answer never came: the group records the loss (the launcher reads it from the events) and
    ends with a QuorumLost, which the groups' launcher says, not the worker (app/cli.py)."""
    from ddptrain.errors import QuorumLost

    g = group("ft.min_replicas=2", "ft.quorum_timeout_s=5")

    def no_answer() -> None:
        raise TimeoutError("no quorum")

    g.manager.start_quorum = no_answer  # type: ignore[method-assign]
    with pytest.raises(QuorumLost, match=r"^replica group 1: no quorum of ft.min_replicas=2 groups within "
                                         r"ft.quorum_timeout_s=5 ") as ended:
        g.begin(4)
    assert ended.value.exit_code == 1
    assert [e["step"] for e in _events(tmp_path) if e["event"] == "quorum_lost"] == [4]
