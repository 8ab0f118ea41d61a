"""DiLoCo and Streaming DiLoCo across torchft replica groups (ddptrain/ft/diloco.py): the outer step against one
written out here by hand, the sync schedule counted at the all-reduce, the bytes against DDP's, and an exact resume
from the middle of a window. Two replica groups run as threads under a real lighthouse (tests/helpers/ft_groups.py).
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

from ddptrain.config.choices import FtSync
from ddptrain.config.schema import FtConfig
from ddptrain.errors import ConfigError
from ddptrain.ft.diloco import OuterSync, ddp_bytes_per_step, split_fragments
from tests.helpers import procs
from tests.helpers.diloco_net import INNER_LR, Net, fresh_net, inner_step
from tests.helpers.ft_groups import group_manager, lighthouse, run_groups

GROUPS = 2
H = 8
LR, MOMENTUM = 0.7, 0.9


@dataclass
class GroupRun:
    params: list[list[torch.Tensor]] = field(default_factory=list)  # after each inner step
    losses: list[float] = field(default_factory=list)
    allreduce_calls: list[int] = field(default_factory=list)  # manager.allreduce calls during each inner step
    allreduce_bytes: int = 0
    records: list[Any] = field(default_factory=list)
    checkpoint: dict[str, Any] | None = None
    checkpoint_ok: list[bool] = field(default_factory=list)
    bytes_per_step: float = 0.0
    names: list[list[str]] = field(default_factory=list)


def train(sync: FtSync, fragments: int, steps: int, save_after: int | None = None,
          resume: list[dict[str, Any]] | None = None) -> list[GroupRun]:
    """Two groups train ``steps`` inner steps under OuterSync; each records what the checks read. ``save_after``:
    the checkpoint (model, inner optimizer, outer state) after that many steps; ``resume``: each group's
    checkpoint to start from, in a fresh lighthouse, managers, model and OuterSync."""
    ft = FtConfig(replica_groups=GROUPS, sync=sync, sync_every=H, fragments=fragments, outer_lr=LR,
                  outer_momentum=MOMENTUM)

    def body(manager: Any, group: int) -> GroupRun:
        run = GroupRun()
        model = fresh_net()
        opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        start = 0
        if resume is not None:
            model.load_state_dict(resume[group]["model"])
            opt.load_state_dict(resume[group]["opt"])
        outer = OuterSync.build(manager, model, opt, ft)
        if resume is not None:
            outer.load_state_dict(copy.deepcopy(resume[group]["outer"]))
            start = outer.inner_steps
        run.names = [f.model_names for f in outer.fragments]
        allreduce = manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            run.allreduce_calls[-1] += 1
            run.allreduce_bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = counted
        with outer:
            for step in range(start, steps):
                run.allreduce_calls.append(0)
                run.losses.append(inner_step(model, opt, group, step))
                run.params.append([p.detach().clone() for p in model.parameters()])
                run.checkpoint_ok.append(outer.checkpoint_ok())
                if save_after == step + 1:
                    run.checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                                    "outer": outer.state_dict()})
        run.records = list(outer.records)
        run.bytes_per_step = outer.bytes_per_step()
        return run

    return run_groups(GROUPS, body)


def reference(steps: int, fragments: list[list[int]], delay: int) -> list[list[list[torch.Tensor]]]:
    """DiLoCo written out: each group's inner AdamW steps on its own data; every ``H / len(fragments)`` steps one
    fragment (in turn) takes the outer step: the pseudo-gradients (window start − local parameters, taken ``delay``
    steps before) averaged over the groups, then SGD with Nesterov momentum on the window start, which every group
    takes as its parameters. Each group's parameters after each step."""
    models = [fresh_net() for _ in range(GROUPS)]
    opts = [torch.optim.AdamW(m.parameters(), lr=INNER_LR) for m in models]
    params = [list(m.parameters()) for m in models]
    start = [p.detach().clone() for p in params[0]]
    momentum: list[torch.Tensor | None] = [None] * len(start)
    interval = H // len(fragments)
    since, outer_steps = 0, 0
    pending: tuple[int, list[torch.Tensor]] | None = None
    out: list[list[list[torch.Tensor]]] = [[] for _ in range(GROUPS)]
    for step in range(steps):
        for g in range(GROUPS):
            inner_step(models[g], opts[g], g, step)
        since += 1
        if since == interval - delay:
            f = outer_steps % len(fragments)
            pending = (f, [sum(start[i] - params[g][i].detach() for g in range(GROUPS)) / GROUPS
                           for i in fragments[f]])
        if since == interval:
            assert pending is not None
            f, pseudo = pending
            with torch.no_grad():
                for i, grad in zip(fragments[f], pseudo, strict=True):
                    buf = momentum[i]
                    buf = grad.clone() if buf is None else MOMENTUM * buf + grad
                    momentum[i] = buf
                    start[i] = start[i] - LR * (grad + MOMENTUM * buf)
                    for g in range(GROUPS):
                        params[g][i].copy_(start[i])
            since, outer_steps, pending = 0, outer_steps + 1, None
        for g in range(GROUPS):
            out[g].append([p.detach().clone() for p in params[g]])
    return out


@pytest.fixture(scope="module")
def diloco_run() -> list[GroupRun]:
    """H = 8, three windows; the checkpoint after 11 steps (3 into the second window)."""
    return train(FtSync.diloco, 1, 3 * H, save_after=H + 3)


def test_outer_step_equals_a_hand_written_diloco_step(diloco_run: list[GroupRun]) -> None:
    ref = reference(3 * H, [list(range(len(list(Net().parameters()))))], delay=0)
    for g, run in enumerate(diloco_run):
        for step, (got, want) in enumerate(zip(run.params, ref[g], strict=True)):
            for p, q in zip(got, want, strict=True):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=f"group {g}, after inner step {step + 1}")
    # the outer step was on: the groups' local parameters differ inside a window, and agree after each sync
    a, b = diloco_run
    assert not torch.equal(a.params[H - 2][0], b.params[H - 2][0])
    for end in (H, 2 * H, 3 * H):
        assert all(torch.equal(p, q) for p, q in zip(a.params[end - 1], b.params[end - 1], strict=True))


def test_the_outer_all_reduce_runs_once_per_window_and_never_between(diloco_run: list[GroupRun]) -> None:
    n_params = len(list(Net().parameters()))  # torchft all-reduces a fragment's pseudo-gradients one per parameter
    for run in diloco_run:
        synced = [step + 1 for step, calls in enumerate(run.allreduce_calls) if calls]
        assert synced == [H, 2 * H, 3 * H]
        assert all(run.allreduce_calls[s - 1] == n_params for s in synced)
        assert [(r.inner_step, r.fragment, r.committed) for r in run.records] == [
            (H, 0, True), (2 * H, 0, True), (3 * H, 0, True)]


def test_diloco_bytes_per_step_are_an_eighth_of_ddps_and_loss_falls(diloco_run: list[GroupRun]) -> None:
    ddp = ddp_bytes_per_step(Net())
    for run in diloco_run:
        # the counter agrees with what went through the manager's all-reduce, per inner step
        assert run.allreduce_bytes / len(run.params) == run.bytes_per_step == sum(r.nbytes for r in run.records) / (
            3 * H)
        assert run.bytes_per_step <= ddp / 4
        assert run.bytes_per_step == ddp / H
        first, last = sum(run.losses[:H]) / H, sum(run.losses[-H:]) / H
        assert last < 0.7 * first, (first, last)


def test_resume_in_the_middle_of_a_window_is_exact(diloco_run: list[GroupRun]) -> None:
    saved = [run.checkpoint for run in diloco_run]
    assert all(c is not None for c in saved)
    outer = saved[0]["outer"]  # type: ignore[index]
    assert outer["since_sync"] == 3 and outer["manager"]["step"] == 1
    # the outer state is not the model's: the window start differs from the local weights it was saved beside
    weight = saved[0]["model"]["inp.weight"]  # type: ignore[index]
    assert not torch.equal(outer["window_start"][0]["inp__weight"], weight)
    resumed = train(FtSync.diloco, 1, 3 * H, resume=saved)  # type: ignore[arg-type]
    for whole, part in zip(diloco_run, resumed, strict=True):
        assert all(torch.equal(p, q) for a, b in zip(whole.params[H + 3:], part.params, strict=True)
                   for p, q in zip(a, b, strict=True))
        assert whole.losses[H + 3:] == part.losses
        assert [step + 1 for step, calls in enumerate(part.allreduce_calls, start=H + 3) if calls] == [2 * H, 3 * H]


def test_streaming_diloco_syncs_each_fragment_at_its_own_step() -> None:
    runs = train(FtSync.streaming_diloco, 2, 2 * H)
    a, b = runs
    names = [n for frag in a.names for n in frag]
    index = {n: i for i, n in enumerate(name for name, _ in Net().named_parameters())}
    # by blocks: the input layer and blocks 0-1, then blocks 2-3 and the output layer
    assert a.names == [["inp.weight", "inp.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                        "blocks.1.bias"],
                       ["blocks.2.weight", "blocks.2.bias", "blocks.3.weight", "blocks.3.bias", "out.weight",
                        "out.bias"]]
    assert sorted(names) == sorted(index)
    fragments = [[index[n] for n in frag] for frag in a.names]
    interval = H // 2
    for run in runs:
        # fragment 0 at 4, fragment 1 at 8, ...: each once per window; each all-reduce starts a step early (the
        # default sync delay of 1 step overlaps it with the next inner step) and carries that fragment only
        assert [(r.inner_step, r.fragment) for r in run.records] == [(4, 0), (8, 1), (12, 0), (16, 1)]
        started = [step + 1 for step, calls in enumerate(run.allreduce_calls) if calls]
        assert started == [interval - 1, 2 * interval - 1, 3 * interval - 1, 4 * interval - 1]
        assert [run.allreduce_calls[s - 1] for s in started] == [6, 6, 6, 6]
        assert run.checkpoint_ok == [(s + 1) % interval != interval - 1 for s in range(2 * H)]
        # each fragment once per window: the whole model per H steps, as plain DiLoCo
        assert run.allreduce_bytes / len(run.params) == run.bytes_per_step == ddp_bytes_per_step(Net()) / H
    for r in a.records:
        synced = fragments[r.fragment]
        other = fragments[1 - r.fragment]
        after_a, after_b = a.params[r.inner_step - 1], b.params[r.inner_step - 1]
        assert all(torch.equal(after_a[i], after_b[i]) for i in synced)
        assert not all(torch.equal(after_a[i], after_b[i]) for i in other)
    ref = reference(2 * H, fragments, delay=1)
    for g, run in enumerate(runs):
        for step, (got, want) in enumerate(zip(run.params, ref[g], strict=True)):
            for p, q in zip(got, want, strict=True):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=f"group {g}, after inner step {step + 1}")


def test_fragments_follow_a_transformers_blocks_and_hold_each_parameter_once() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    parts = split_fragments(model, 2)
    first, second = (f.model_names for f in parts)
    assert first[0] == "model.embed_tokens.weight" and second[-1] == "model.norm.weight"
    assert {n.split(".")[2] for n in first if ".layers." in n} == {"0", "1"}
    assert {n.split(".")[2] for n in second if ".layers." in n} == {"2", "3"}
    # the tied head is the embedding: one tensor, one fragment; the fragments are the model's own parameters
    assert sum(len(list(f.parameters())) for f in parts) == len(list(model.parameters()))
    assert next(parts[0].parameters()) is model.model.embed_tokens.weight
    # cut where the bytes even out: a large vocabulary's embedding outweighs a block, so it stands with block 0 alone
    config.vocab_size = 1024
    big_vocab = [f.model_names for f in split_fragments(LlamaForCausalLM(config), 2)]
    assert [{n.split(".")[2] for n in names if ".layers." in n} for names in big_vocab] == [{"0"}, {"1", "2", "3"}]
    # without blocks: contiguous runs of about equal bytes
    mlp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert [f.model_names for f in split_fragments(mlp, 2)] == [["0.weight", "0.bias", "1.weight", "1.bias"],
                                                               ["2.weight", "2.bias", "3.weight", "3.bias"]]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"sync": FtSync.ddp}, "ft.sync=ddp"),
    ({"sync": FtSync.diloco, "fragments": 2}, "ft.fragments=2: fragments are for ft.sync=streaming_diloco"),
    ({"sync": FtSync.streaming_diloco, "fragments": 3}, "ft.sync_every=8: expected a multiple of ft.fragments=3"),
    ({"sync": FtSync.streaming_diloco, "fragments": 20, "sync_every": 20}, "ft.fragments=20: the model has only"),
])
def test_bad_settings_are_one_line_naming_the_key(overrides: dict[str, Any], message: str) -> None:
    ft = FtConfig(replica_groups=2, **overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        OuterSync.build(None, Net(), torch.optim.SGD(Net().parameters(), lr=0.1), ft)  # type: ignore[arg-type]


def test_streaming_resume_keeps_the_fragment_order_and_is_exact() -> None:
    """Saved 1 step after the third fragment sync: the next is fragment 1 (the manager's step says so), 3 steps on."""
    whole = train(FtSync.streaming_diloco, 2, 2 * H, save_after=13)
    saved = [run.checkpoint for run in whole]
    assert saved[0]["outer"]["since_sync"] == 1 and saved[0]["outer"]["manager"]["step"] == 3  # type: ignore[index]
    part = train(FtSync.streaming_diloco, 2, 2 * H, resume=saved)  # type: ignore[arg-type]
    for a, b in zip(whole, part, strict=True):
        assert [(r.inner_step, r.fragment) for r in b.records] == [(4, 0), (8, 1), (12, 0), (16, 1)]
        assert all(torch.equal(p, q) for x, y in zip(a.params[13:], b.params, strict=True)
                   for p, q in zip(x, y, strict=True))


def test_no_checkpoint_while_a_fragments_all_reduce_is_in_flight() -> None:
    def body(manager: Any, group: int) -> str:
        model = fresh_net()
        opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        ft = FtConfig(replica_groups=GROUPS, sync=FtSync.streaming_diloco, sync_every=H, fragments=2)
        outer = OuterSync.build(manager, model, opt, ft)
        with outer:
            for step in range(3):  # the third starts fragment 0's all-reduce, awaited at the fourth
                inner_step(model, opt, group, step)
            with pytest.raises(RuntimeError, match="in flight") as caught:
                outer.state_dict()
            inner_step(model, opt, group, 3)
            outer.state_dict()
        return str(caught.value)

    assert all("inner step 3 of 4" in m for m in run_groups(GROUPS, body))


@pytest.mark.slow
def test_two_group_processes_under_the_lighthouse_command_take_the_hand_written_outer_step(tmp_path: Path) -> None:
    """The same check across processes: torchft's lighthouse server as a local run starts it (its own process,
    ``ddptrain/ft/lighthouse.py``'s command) and one process per group."""
    from ddptrain.ft.lighthouse import command

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs.start([*command(), "--min_replicas", str(GROUPS), "--join_timeout_ms", "2000", "--bind", f"[::]:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    workers = [procs.start([sys.executable, "-m", "tests.helpers.ft_diloco_worker", "--group", str(g), "--groups",
                            str(GROUPS), "--sync", "diloco", "--sync-every", str(H), "--fragments", "1", "--steps",
                            str(2 * H), "--lighthouse", f"http://localhost:{port}", "--out", str(tmp_path / f"{g}.pt")],
                           env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for g in range(GROUPS)]
    for w in workers:
        out, _ = w.communicate(timeout=300)
        assert w.returncode == 0, out[-3000:]
    runs = [torch.load(tmp_path / f"{g}.pt") for g in range(GROUPS)]
    ref = reference(2 * H, [list(range(len(list(Net().parameters()))))], delay=0)
    for g, run in enumerate(runs):
        assert run["records"] == [(H, 0, True), (2 * H, 0, True)]
        assert run["bytes_per_step"] == ddp_bytes_per_step(Net()) / H
        for step, (got, want) in enumerate(zip(run["params"], ref[g], strict=True)):
            for p, q in zip(got, want, strict=True):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=f"group {g}, after inner step {step + 1}")


@pytest.mark.parametrize(("sync", "fragments", "every", "message"), [
    (FtSync.diloco, 1, 4, "checkpoint: its DiLoCo state has sync_every=8, this run 4: resume with the same"),
    (FtSync.streaming_diloco, 2, H, "checkpoint: its DiLoCo state has fragments=1, this run 2: resume with the same"),
])
def test_a_checkpoint_of_another_window_is_refused_in_one_line(diloco_run: list[GroupRun], sync: FtSync,
                                                                fragments: int, every: int, message: str) -> None:
    saved = diloco_run[0].checkpoint
    assert saved is not None

    def body(manager: Any, group: int) -> str:
        model = fresh_net()
        ft = FtConfig(replica_groups=GROUPS, sync=sync, sync_every=every, fragments=fragments)
        outer = OuterSync.build(manager, model, torch.optim.AdamW(model.parameters()), ft)
        with pytest.raises(ConfigError) as caught:
            outer.load_state_dict(saved["outer"])
        return str(caught.value)

    for refusal in run_groups(GROUPS, body):
        assert refusal.startswith(message) and "\n" not in refusal


@pytest.mark.slow
def test_a_group_that_rejoins_heals_its_window_start_and_outer_momentum_from_a_peer() -> None:
    """Window H = 4, lighthouse needing 1 group. Groups 0 and 1 sync at step 4; group 1 dies 2 steps into the
    second window, group 0 syncs alone at 8; a fresh group 1 (step 0, fresh weights) joins group 0's sync at 12 and
    heals from it: model, inner optimizer (the state the trainer registers), and the outer state torchft carries
    for each fragment. From that sync on the two agree bit for bit."""
    every = 4
    ft = FtConfig(replica_groups=GROUPS, sync=FtSync.diloco, sync_every=every, min_replicas=1)
    both_at_sync, dead, alone, rejoining = threading.Barrier(GROUPS), *(threading.Event() for _ in range(3))

    def group(manager: Any, g: int, steps: int, pause: dict[int, Callable[[], object]]) -> dict[str, Any]:
        model = fresh_net()
        opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        manager.register_state_dict_fn(
            "default", lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
            lambda: {"model": model.state_dict(), "opt": opt.state_dict()})
        outer = OuterSync.build(manager, model, opt, ft)
        with outer:
            for step in range(steps):
                if step in pause:
                    pause[step]()
                inner_step(model, opt, g, step)
        state = outer.state_dict()
        return {"params": [p.detach().clone() for p in model.parameters()], "outer": state,
                "records": [(r.inner_step, r.fragment, r.committed) for r in outer.records]}

    def join_after_the_returning_group() -> None:
        # the returning group asks for the quorum first: alone it is not a majority of the two live groups, so the
        # lighthouse waits for group 0 (asking first, group 0 would get a quorum of its own: its last one's members)
        rejoining.wait()
        time.sleep(1.0)

    def survivor(address: str) -> dict[str, Any]:
        with group_manager(address, 0, 1) as manager:
            return group(manager, 0, 3 * every, {every - 1: both_at_sync.wait, every + 2: dead.wait,
                                                 2 * every: alone.set, 3 * every - 1: join_after_the_returning_group})

    def victim(address: str) -> dict[str, Any]:
        with group_manager(address, 1, 1) as manager:
            out = group(manager, 1, every + 2, {every - 1: both_at_sync.wait})
        dead.set()
        return out

    def returning(address: str) -> dict[str, Any]:
        alone.wait()  # until group 0 has synced alone at 8
        with group_manager(address, 1, 1) as manager:
            return group(manager, 1, every, {every - 1: rejoining.set})

    with lighthouse(1, heartbeat_timeout_ms=1000) as address, ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(fn, address) for fn in (survivor, victim, returning)]
        first, gone, back = (f.result(timeout=120) for f in futures)
    assert first["records"] == [(4, 0, True), (8, 0, True), (12, 0, True)]
    assert gone["records"] == [(4, 0, True)]
    assert back["outer"]["manager"]["step"] == first["outer"]["manager"]["step"] == 3
    assert all(torch.equal(p, q) for p, q in zip(first["params"], back["params"], strict=True))
    for a, b in zip(first["outer"]["window_start"], back["outer"]["window_start"], strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    momenta = [[s["momentum_buffer"] for s in o["outer"]["outer_optimizers"][0]["state"].values()]
               for o in (first, back)]
    assert momenta[0] and all(torch.equal(a, b) for a, b in zip(*momenta, strict=True))
