"""The steady step is stall-free: gradient collectives only, no host read; non-finite steps still decided alike."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddptrain.config.choices import OptimImpl
from ddptrain.config.compose import build_config
from ddptrain.errors import ConfigError
from ddptrain.optim import impl_kwargs, resolve_impl
from ddptrain.step.compute import apply_update
from ddptrain.step.control import NonFiniteSteps, StopRequest, guard_loss
from tests.helpers.dist import run_distributed
from tests.helpers.host_reads import HostReads
from tests.helpers.runs import Overrides, train_each

TINY: Overrides = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "vocab_size": 256},
    "data": {"source": "synthetic", "num_samples": 256, "vocab_size": 256, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"eval_every": 0, "seed": 3},
    "optim": {"warmup_steps": 1},
}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_object", "broadcast_object_list", "barrier", "_broadcast_coalesced", "all_to_all_single")


def _instrumented_run(rank: int, world_size: int, tmp: str, base: Overrides, variant: Overrides) -> dict[str, Any]:
    """Train once, logging every collective and host read against the step it happened in."""
    from ddptrain.telemetry.metrics import StepMetrics
    from ddptrain.train.trainer import Trainer

    events: list[tuple[Any, ...]] = []
    step = [0]

    def wrap(owner: Any, name: str, kind: str, size: Callable[..., int]) -> None:
        original = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            events.append((step[0], kind, name, size(*args)))
            return original(*args, **kwargs)

        setattr(owner, name, recorded)

    def numel(*args: Any) -> int:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return sum(t.numel() for t in tensors) if tensors else -1

    for name in COLLECTIVES:
        if hasattr(dist, name):
            wrap(dist, name, "collective", numel)
    reads = HostReads(torch.device("cpu"), lambda name, why: events.append((step[0], "host_read", name, why)))
    build = Trainer.__init__

    def on_the_runs_device(self: Trainer, cfg: Any, env: Any, device: torch.device, *args: Any) -> None:
        reads.run_device = device  # the object the loop places tensors with
        build(self, cfg, env, device, *args)

    Trainer.__init__ = on_the_runs_device  # type: ignore[method-assign]  # this forked rank only
    start_step = StepMetrics.start_step

    def mark(self: StepMetrics, n: int) -> None:
        step[0] = n
        start_step(self, n)

    StepMetrics.start_step = mark  # type: ignore[method-assign]
    with reads:
        (result,) = train_each(rank, world_size, tmp, base, [variant])
    n_params = result["summary"]["parameters"]
    return {"events": events, "n_params": n_params, "metrics": result["metrics"]}


def _by_step(events: list[tuple[Any, ...]], step: int, kind: str) -> list[tuple[str, int]]:
    return [(name, size) for s, k, name, size in events if s == step and k == kind]


@pytest.mark.parametrize("step", [2, 5, 7])
def test_a_steady_step_issues_only_gradient_all_reduces_and_reads_nothing_back(
    runs: list[dict[str, Any]], step: int
) -> None:
    for rank in (r["counted"] for r in runs):
        collectives = _by_step(rank["events"], step, "collective")
        assert {name for name, _ in collectives} == {"all_reduce"}, collectives
        assert sum(size for _, size in collectives) == rank["n_params"], "the buckets hold every gradient once"
        assert _by_step(rank["events"], step, "host_read") == []


def test_the_host_read_detector_sees_every_device_to_host_path_and_no_placement() -> None:
    """What the steady-step test relies on: torch routes each of these calls through a ``TorchFunctionMode``, and
    the detector tells the copies to the host from placements on the run's device."""
    device, seen = torch.device("cpu"), []
    x = torch.randn(4, device=device)
    mask, p = x > 0, torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with HostReads(device, lambda name, why: seen.append(name)):
        x.to(device, non_blocking=True), x.to(device), x.to(x.device), x.to(torch.float64), x.add_(1)
        torch.zeros(4, device=device).copy_(x), torch.empty(4).copy_(x, non_blocking=True)
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        assert seen == [], seen
        x.sum().item(), x.tolist(), bool(x[0] > 0), float(x.sum()), int(x[0]), x.numpy(), f"{x.sum()}"
        x.cpu(), x.to("cpu"), x.to(torch.device("cpu")), x.to(device="cpu"), x.to(x.cpu())
        torch.empty(4).copy_(x), x.cpu().copy_(x)  # on CPU x.cpu() is x: from here on x counts as a host tensor
        x.nonzero(), torch.equal(x, x), x[mask], torch.where(mask), x.unique(), torch.masked_select(x, mask)
        x[mask] = 0
    assert seen == ["item", "tolist", "__bool__", "__float__", "__int__", "numpy", "__format__",
                    "cpu", "to", "to", "to", "cpu", "to", "copy_", "cpu", "copy_",
                    "nonzero", "equal", "__getitem__", "where", "unique", "masked_select", "__setitem__"], seen


# A check step agrees on the stop signal, on one slot per step since the last check (check_every = 3) and on the
# replicas' fingerprint (train.drift_policy: one replica group, 2 words and their complements): size 1 + 3 + 4.
# A logging step also sums the token counts (real, computed, squared sequence lengths, untimed: size 4) and gathers
# every rank's phase times for the straggler report (all_gather_object, size -1).
AGREEMENT = 1 + 3 + 4


@pytest.mark.parametrize(("step", "extra"), [(3, [AGREEMENT]), (6, [AGREEMENT]), (4, [AGREEMENT, 1, 4, -1])],
                         ids=["check-3", "check-6", "log-4"])
def test_check_and_logging_steps_add_only_their_documented_reductions(
    runs: list[dict[str, Any]], step: int, extra: list[int]
) -> None:
    """A check step adds the agreement (stop, one slot per step since the last check, the replicas' fingerprint:
    computed on the device, it adds neither a collective nor a host read); a logging step also the loss mean, the
    sum of the ranks' token counts, and the gather of per-rank timings for the straggler report."""
    for rank in (r["counted"] for r in runs):
        collectives = _by_step(rank["events"], step, "collective")
        gradients = [size for name, size in collectives if name == "all_reduce" and size > AGREEMENT]
        assert sum(gradients) == rank["n_params"]
        assert [size for _, size in collectives if size <= AGREEMENT] == extra, collectives
        # The agreed flags; a logging step also reads the loss mean and the gradient norm, and torch's
        # all_gather_object (the straggler report) reads its own object sizes: logging steps sync by design.
        reads = sorted(name for name, _ in _by_step(rank["events"], step, "host_read"))
        if step == 4:
            assert {"tolist", "__float__"} <= set(reads) and reads.count("__float__") >= 2, reads
        else:
            assert reads == ["tolist"], reads


def _capture_models(models: list[torch.nn.Module]) -> None:
    """Keep every model the loop builds, to compare the ranks' parameters after training."""
    import ddptrain.train.trainer as trainer

    build = trainer.build_model

    def keep(*args: Any, **kwargs: Any) -> torch.nn.Module:
        models.append(build(*args, **kwargs))
        return models[-1]

    trainer.build_model = keep


def _nonfinite_run(rank: int, world_size: int, tmp: str, policy: str, impl: str) -> dict[str, Any]:
    """Rank 1's loss of step 2 is NaN; steps 2-3 are not check steps, step 4 is."""
    os.environ["DDPTRAIN_FAULT"] = "nan@step:2:1"
    models: list[torch.nn.Module] = []
    _capture_models(models)
    variant: Overrides = {"train": {"steps": 5, "log_every": 5, "check_every": 4, "nan_policy": policy},
                          "optim": {"impl": impl}}
    run_dir = os.path.join(tmp, f"{policy}-{impl}")
    try:
        (result,) = train_each(rank, world_size, run_dir, TINY, [variant])
    except Exception as exc:  # noqa: BLE001 - the abort is the expected outcome; the parent checks its text
        return {"error": f"{type(exc).__name__}: {exc}",
                "checkpoints": [str(p) for p in Path(run_dir).glob("*/checkpoints/step_*")]}
    finally:
        del os.environ["DDPTRAIN_FAULT"]
    params = torch.cat([p.detach().flatten() for p in models[-1].parameters()])
    return {"metrics": result["metrics"], "params": params}


def _sigterm_run(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank 0 gets SIGTERM after step 4; checks fall every 3 steps, so every rank stops after step 6. Returns what
    the console said of the stop and the steps metrics.jsonl logged."""
    import json
    import logging
    import signal

    import ddptrain.train.trainer as trainer
    from ddptrain.runtime.hooks import StepHooks

    class TerminateAfterStep4(StepHooks):
        def step_ended(self, step: int) -> None:
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    class Notices(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    step_hooks = trainer.step_hooks
    trainer.step_hooks = lambda r, g=None: TerminateAfterStep4() if r == 0 else step_hooks(r, g)  # type: ignore[assignment]
    run_dir = os.path.join(tmp, "sigterm")
    notices = Notices()
    logging.getLogger("ddptrain").addHandler(notices)
    # A long grace: the SIGTERM watchdog must not end this worker, which goes on to other runs.
    variant: Overrides = {"train": {"steps": 20, "log_every": 20, "check_every": 3}, "launch": {"stop_grace_s": 900}}
    try:
        train_each(rank, world_size, run_dir, TINY, [variant])
    except trainer.Stopped as exc:
        logged = [json.loads(line)["step"] for f in Path(run_dir).glob("*/metrics.jsonl")
                  for line in f.read_text().splitlines()]
        return {"exit_code": exc.exit_code, "message": str(exc), "logged_steps": logged,
                "notices": [line for line in notices.lines if "received" in line],
                "checkpoints": sorted(p.name for p in Path(run_dir).glob("*/checkpoints/step_*"))}
    finally:
        trainer.step_hooks = step_hooks  # type: ignore[assignment]
        logging.getLogger("ddptrain").removeHandler(notices)
    return {"exit_code": 0}


def _every_run(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """All the distributed runs of this module in one process group (spawning one costs tens of seconds)."""
    out = {f"{policy}-{impl}": _nonfinite_run(rank, world_size, tmp, policy, impl)
           for policy, impl in (("skip", "fused"), ("skip", "foreach"), ("abort", "fused"))}
    out["sigterm"] = _sigterm_run(rank, world_size, tmp)
    # Last: it instruments torch.distributed and torch.Tensor for good in this process.
    variant: Overrides = {"train": {"steps": 8, "log_every": 4, "check_every": 3},
                          "parallel": {"broadcast_buffers": False}}  # else DDP broadcasts llama's RoPE buffer
    out["counted"] = _instrumented_run(rank, world_size, os.path.join(tmp, "counted"), TINY, variant)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Counted: 8 steps, logging at 4 and 8, checks every 3 steps. Non-finite: rank 1's NaN at step 2."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_every_run, 2, tmp, timeout=600)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_one_ranks_nan_between_checks_is_skipped_on_every_rank(runs: list[dict[str, Any]], impl: str) -> None:
    ranks = [r[f"skip-{impl}"] for r in runs]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "both ranks skipped the same update"
    assert torch.isfinite(ranks[0]["params"]).all()
    assert ranks[0]["metrics"][-1]["skipped_steps"] == 1


def test_one_ranks_nan_between_checks_aborts_every_rank_naming_the_step(runs: list[dict[str, Any]]) -> None:
    for rank in (r["abort-fused"] for r in runs):
        assert rank["error"].startswith("NonFiniteError: non-finite loss or gradients at step 2 "), rank
        assert rank["checkpoints"] == [], "no checkpoint after the non-finite step"


def test_sigterm_between_checks_stops_every_rank_at_the_next_check_with_a_checkpoint(
    runs: list[dict[str, Any]],
) -> None:
    import signal

    for rank in (r["sigterm"] for r in runs):
        assert rank["exit_code"] == 128 + signal.SIGTERM, rank
        assert "after step 6" in rank["message"]
        assert rank["checkpoints"] == ["step_000006"]


def test_a_stop_logs_the_step_it_stopped_at_and_the_notice_names_the_check_it_waits_for(
    runs: list[dict[str, Any]],
) -> None:
    """The stop's step is no logging step (train.log_every=20), yet metrics.jsonl (rank 0 writes it) ends with it,
    so a resumed run's lines continue from it; the notice on the rank that got the signal (after step 4) says the
    run stops at the next check step, step 6 at the latest, not at the next step."""
    stopped = [r["sigterm"] for r in runs]
    assert stopped[0]["logged_steps"] == [6], stopped[0]
    assert stopped[0]["notices"] == ["SIGTERM received: stopping at the next check step, step 6 at the latest "
                                     "(train.check_every=3), after saving a checkpoint"], stopped[0]
    assert stopped[1]["notices"] == []  # rank 1 got no signal: it stopped on the ranks' agreement


@pytest.mark.parametrize(("step", "check_every", "last_step", "latest"), [
    (0, 3, 20, 3),  # before step 1 of a fresh run: the first check
    (4, 3, 20, 6),
    (6, 3, 20, 9),  # step 6 (a check step) in progress or over: its check may have passed already
    (6, 3, None, 9),
    (19, 3, 20, 20),  # the run's last step checks before step 21 would
    (20, 3, 20, 20),
    (7, 1, 20, 8),
])
def test_the_stop_notice_names_the_first_check_step_after_the_step_in_progress_and_never_past_the_last(
    step: int, check_every: int, last_step: int | None, latest: int,
) -> None:
    """``StopRequest.notice`` alone (the signal's arrival within a step is not known): the latest step it can stop at
    is the next multiple of train.check_every after the step in progress, and the run's last step when that
    comes first."""
    stop = StopRequest(900.0, check_every, last_step, step)
    try:
        assert stop.notice() == (f"stopping at the next check step, step {latest} at the latest "
                                 f"(train.check_every={check_every}), after saving a checkpoint")
    finally:
        stop.restore()


def test_guard_keeps_a_finite_loss_exactly_and_poisons_the_gradients_of_a_non_finite_one() -> None:
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    loss = (w * torch.tensor([0.3, 0.7])).sum()
    guarded = guard_loss(loss)
    guarded.backward()
    assert guarded.item() == loss.item() and torch.equal(w.grad, torch.tensor([0.3, 0.7]))
    w.grad = None
    infinite = (w * torch.tensor([0.3, 0.7])).sum() + torch.tensor(math.inf)  # gradients alone would be finite
    guard_loss(infinite).backward()
    assert torch.isnan(w.grad).all()


@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
def test_a_non_finite_step_leaves_parameters_and_optimizer_state_untouched(impl: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **impl_kwargs(OptimImpl(impl), torch.device("cpu")))
    model(torch.randn(2, 4)).sum().backward()
    apply_update(optimizer, torch.tensor(False))
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    model(torch.full((2, 4), math.nan)).sum().backward()
    apply_update(optimizer, torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(v, s[k]) for s, new in zip(state, optimizer.state.values(), strict=True)
               for k, v in new.items())
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_steps_are_recorded_on_the_device_one_slot_per_step() -> None:
    steps = NonFiniteSteps(torch.device("cpu"), check_every=4, fp16=False)
    for step, bad in [(5, False), (6, True), (7, False), (8, True)]:
        steps.record(step, torch.tensor(bad), torch.tensor(1.0))
    assert steps.gradients.tolist() == [0.0, 6.0, 0.0, 8.0] and steps.events is steps.gradients


def test_in_fp16_a_non_finite_loss_is_the_event_and_an_overflow_only_a_gradient_verdict() -> None:
    steps = NonFiniteSteps(torch.device("cpu"), check_every=3, fp16=True)
    steps.record(1, torch.tensor(True), torch.tensor(math.nan))  # a non-finite loss poisons the gradients too
    steps.record(2, torch.tensor(True), torch.tensor(2.5))  # an overflow from a finite loss
    steps.record(3, torch.tensor(False), torch.tensor(2.5))
    assert (steps.gradients.tolist(), steps.events.tolist()) == ([1.0, 2.0, 0.0], [1.0, 0.0, 0.0])


def test_auto_picks_the_fused_kernel_where_torch_has_one() -> None:
    assert resolve_impl(OptimImpl.auto, torch.device("cpu")) == OptimImpl.fused
    assert resolve_impl(OptimImpl.auto, torch.device("meta")) == OptimImpl.foreach
    assert impl_kwargs(OptimImpl.for_loop, torch.device("cpu")) == {"foreach": False}
    with pytest.raises(ConfigError, match=r"optim\.impl=fused"):
        impl_kwargs(OptimImpl.fused, torch.device("meta"))


def test_bad_check_every_impl_or_compile_with_an_own_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.check_every=0"):
        build_config({"train": {"check_every": 0}})
    with pytest.raises(ConfigError, match="impl"):
        build_config({"optim": {"impl": "fast"}})
    with pytest.raises(ConfigError, match=r"train\.compile=true .* parallel\.engine=bucketed"):
        build_config({"train": {"compile": True}, "parallel": {"engine": "bucketed"}})


def _eager_then_compiled(rank: int, world_size: int, tmp: str, base: Overrides) -> dict[str, Any]:
    """``base`` trained eager, then with ``train.compile=true`` from a fresh Dynamo, whose graph and frame counts
    the compiled run alone fills."""
    from torch._dynamo.utils import counters

    (eager,) = train_each(rank, world_size, f"{tmp}/eager", base, [{}])
    torch.compiler.reset()
    counters.clear()
    (compiled,) = train_each(rank, world_size, f"{tmp}/compiled", base, [{"train": {"compile": True}}])
    return {"eager": eager, "compiled": compiled, "graphs": counters["stats"]["unique_graphs"],
            "frames": dict(counters["frames"])}


@pytest.mark.slow
def test_compiled_blocks_under_ddp_match_eager_share_one_graph_and_report_compile_time() -> None:
    """Regional compilation on 2 ranks with CPU inductor, through the loop (``train.compile=true``): the same
    losses as eager over 5 steps, and on every rank the 12 blocks (more than Dynamo's recompile limit of 8) are one
    graph, one frame, no recompile. One run serves both: compiling is most of its cost (``tests/test_pretrained.py``
    checks the one-graph rule with Dynamo's eager backend in the fast tier)."""
    base: Overrides = {**TINY, "model": {**TINY["model"], "num_layers": 12},
                       "train": {**TINY["train"], "steps": 5, "log_every": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_distributed(_eager_then_compiled, 2, tmp, base, timeout=600)
    eager, compiled = ranks[0]["eager"], ranks[0]["compiled"]
    losses = [[m["loss"] for m in run["metrics"]] for run in (eager, compiled)]
    assert len(losses[0]) == 5
    for a, b in zip(*losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), losses
    assert compiled["summary"]["compile_s"] > 0 and "compile_s" not in eager["summary"]
    for rank, ran in enumerate(ranks):
        assert ran["graphs"] == 1 and ran["frames"]["total"] == ran["frames"]["ok"] == 1, (rank, ran["graphs"],
                                                                                            ran["frames"])
