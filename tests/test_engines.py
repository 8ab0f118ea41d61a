"""Every from-scratch engine trains exactly like torch DDP: same gradients after every backward, same parameters.

One spawned gloo group per world size runs every case against torch DDP and every engine (spawning costs
seconds, the cases milliseconds); the parametrized tests below then compare the recorded traces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.comm import all_reduce_bytes
from ddptrain.engines import ENGINES, BucketedDDP, NaiveDDP, StreamBucketedDDP, build_engine
from ddptrain.engines.buckets import assign_buckets
from ddptrain.engines.graph import reachable_leaves
from tests.helpers.dist import run_distributed

# An engine spec is a config name, optionally with ":ring" (collective=ring), ":view" (gradient_as_bucket_view)
# and ":triton" (parallel.kernels=triton, through Triton's interpreter: slow, so on 2 ranks only).
SPECS = [*ENGINES, "bucketed:ring", "overlap_async:ring", "bucketed:view"]
TRITON_SPECS = ["bucketed:triton", "bucketed:view:triton", "stream_bucketed:triton"]
Trace = dict[str, Any]
Wrap = Callable[[nn.Module], nn.Module]


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TiedLM(nn.Module):
    """GPT-2 style: the output projection is the input embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.block(self.wte(ids))))


class Branches(nn.Module):
    """Each forward takes one branch; ``never`` takes part in no forward at all."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b, self.never = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return getattr(self, branch)(torch.relu(self.trunk(x)))


class NormNet(nn.Module):
    """BatchNorm running statistics are buffers that forward updates from each rank's own data; they start random,
    so a rank that never received rank 0's buffers shows it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 4), nn.BatchNorm1d(4)
        self.norm.running_mean.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class Wide(nn.Module):
    """16 KB weights: with bucket_cap_mb=0.01 (10 KB) every weight closes a bucket of its own: 4 buckets. Each bucket
    is two launches per backward for Triton's interpreter, 15-20 ms of CPU each (it re-patches triton.language at
    every call of a kernel's helper functions): the 6 layers this had cost the Triton test about 1 CPU s more."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.repeat(1, 8))


class Structured(nn.Module):
    """Returns a dict holding a tensor and a tuple, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.body(x))
        return {"logits": self.head(h), "extra": (self.aux(h), h.mean())}


def _data(rank: int, step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def _train(
    wrapped: nn.Module,
    module: nn.Module,
    micro_steps: list[list[Any]],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    zero_grad: bool = True,
) -> Trace:
    """SGD with momentum over steps of micro-batches (all but the last under no_sync); gradients after each backward."""
    trace: Trace = {"initial": {n: p.detach().clone() for n, p in module.state_dict().items()}, "grads": []}
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for micro in micro_steps:
        for k, batch in enumerate(micro):
            with wrapped.no_sync() if k < len(micro) - 1 else nullcontext():  # type: ignore[operator]
                loss(wrapped, batch).backward()
            trace["grads"].append(_snapshot(module))
        opt.step()
        if zero_grad:
            opt.zero_grad()
    trace["final"] = {n: t.detach().clone() for n, t in module.state_dict().items()}
    return trace


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def case_multistep(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(MLP, 0)
    return _train(wrap(module), module, [[_data(rank, s)] for s in range(4)], _mse)


def single_process_multistep(world: int) -> Trace:
    """The reference: one process, one model, the ranks' batches concatenated."""
    module = _seeded(MLP, 0)
    steps = [[_data(r, s) for r in range(world)] for s in range(4)]
    return _train(module, module, [[(torch.cat([x for x, _ in p]), torch.cat([y for _, y in p]))] for p in steps], _mse)


def case_no_sync(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(MLP, 0)
    return _train(wrap(module), module, [[_data(rank, 3 * s + k) for k in range(3)] for s in range(3)], _mse)


def case_tied(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(TiedLM, 0)
    g = torch.Generator().manual_seed(rank)
    batches = [[torch.randint(0, 16, (2, 6), generator=g)] for _ in range(3)]

    def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return _train(wrap(module), module, batches, loss)


def case_frozen(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(MLP, rank)
    module.fc1.requires_grad_(False)
    return _train(wrap(module), module, [[_data(rank, s)] for s in range(3)], _mse)


def case_unused(rank: int, world: int, wrap: Wrap, zero_grad: bool = True) -> Trace:
    """Step 0: ranks disagree on the branch; step 1: all take ``a``; step 2: disagree the other way round."""
    module = _seeded(Branches, 0)
    plan = ["a", "a", "b"] if rank == 0 else ["b", "a", "a"]
    batches = [[(*_data(rank, s), plan[s])] for s in range(3)]
    return _train(wrap(module), module, batches, lambda m, b: F.mse_loss(m(b[0], b[2]), b[1]), zero_grad)


def case_unused_stale_grads(rank: int, world: int, wrap: Wrap) -> Trace:
    """Without zero_grad, a locally unused parameter contributes its stale gradient, as in torch DDP."""
    return case_unused(rank, world, wrap, zero_grad=False)


def case_seeds(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(MLP, 1 + rank)
    return _train(wrap(module), module, [[_data(rank, s)] for s in range(2)], _mse)


def case_buffers(rank: int, world: int, wrap: Wrap) -> Trace:
    """The forward after a no_sync one does not broadcast buffers (torch DDP's rule); the one after that does."""
    module = _seeded(NormNet, rank)
    return _train(wrap(module), module, [[_data(rank, 2 * s + k, n=6) for k in range(2)] for s in range(3)], _mse)


def case_small_buckets(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(Wide, 0)
    return _train(wrap(module), module, [[_data(rank, s)] for s in range(3)], _mse)


def case_structured_outputs(rank: int, world: int, wrap: Wrap) -> Trace:
    module = _seeded(Structured, 0)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        aux, mean = out["extra"]
        return F.mse_loss(out["logits"], batch[1]) + aux.square().mean() + mean

    return _train(wrap(module), module, [[_data(rank, s)] for s in range(3)], loss)


# case -> (function, torch-DDP keyword arguments it needs, shared by the engines)
CASES: dict[str, tuple[Callable[[int, int, Wrap], Trace], dict[str, Any]]] = {
    "multistep": (case_multistep, {}),
    "no_sync": (case_no_sync, {}),
    "tied": (case_tied, {}),
    "frozen": (case_frozen, {}),
    "unused": (case_unused, {"find_unused_parameters": True}),
    "unused_stale_grads": (case_unused_stale_grads, {"find_unused_parameters": True}),
    "seeds": (case_seeds, {}),
    "buffers": (case_buffers, {}),
    "buffers_not_broadcast": (case_buffers, {"broadcast_buffers": False}),
    "small_buckets": (case_small_buckets, {"bucket_cap_mb": 0.01}),
    "structured_outputs": (case_structured_outputs, {"find_unused_parameters": True}),
}


def _wrapper(spec: str, kwargs: dict[str, Any]) -> Wrap:
    if spec == "torch":
        return lambda m: DistributedDataParallel(m, **kwargs)
    name, *flags = spec.split(":")
    extra = {"collective": "ring" if "ring" in flags else "native", "gradient_as_bucket_view": "view" in flags,
             "kernels": "triton" if "triton" in flags else "torch"}

    def wrap(module: nn.Module) -> nn.Module:
        engine = build_engine(name, module, **kwargs, **extra)
        assert engine.reducer.kernels.name == extra["kernels"]
        return engine

    return wrap


def _conformance(rank: int, world: int) -> dict[tuple[str, str], Trace]:
    """Every case under torch DDP and every engine spec, plus the single-process reference."""
    traces = {("multistep", "single"): single_process_multistep(world)}
    for case, (fn, kwargs) in CASES.items():
        for spec in ["torch", *SPECS]:
            traces[case, spec] = fn(rank, world, _wrapper(spec, kwargs))
    return traces


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def traces(request: pytest.FixtureRequest) -> list[dict[tuple[str, str], Trace]]:
    return run_distributed(_conformance, request.param)


def _conformance_triton(rank: int, world: int) -> dict[tuple[str, str], Trace]:
    """Every case under torch DDP and the engines on Triton's kernels, run by its interpreter on the CPU."""
    os.environ["TRITON_INTERPRET"] = "1"  # before this process compiles any Triton kernel
    return {
        (case, spec): fn(rank, world, _wrapper(spec, kwargs))
        for case, (fn, kwargs) in CASES.items()
        for spec in ["torch", *TRITON_SPECS]
    }


@pytest.fixture(scope="module")
def triton_traces() -> list[dict[tuple[str, str], Trace]]:
    return run_distributed(_conformance_triton, 2)


def _assert_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


def _assert_same(got: Trace, want: Trace, what: str) -> None:
    assert len(got["grads"]) == len(want["grads"]), what
    for i, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        for name, w in w_step.items():
            g = g_step[name]
            assert (g is None) == (w is None), f"{what}: backward {i}, {name}.grad is {g} where torch DDP has {w}"
            if w is not None:
                _assert_close(g, w, f"{what}: backward {i} {name}")
    for key in ("initial", "final"):
        for name, w in want[key].items():
            _assert_close(got[key][name], w, f"{what}: {key} {name}")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("case", CASES)
def test_engine_matches_torch_ddp(traces: list[dict[tuple[str, str], Trace]], case: str, spec: str) -> None:
    for rank, by_run in enumerate(traces):
        _assert_same(by_run[case, spec], by_run[case, "torch"], f"rank {rank} {case} {spec}")


@pytest.mark.parametrize("spec", TRITON_SPECS)
@pytest.mark.parametrize("case", CASES)
def test_engine_on_triton_kernels_matches_torch_ddp(
    triton_traces: list[dict[tuple[str, str], Trace]], case: str, spec: str
) -> None:
    for rank, by_run in enumerate(triton_traces):
        _assert_same(by_run[case, spec], by_run[case, "torch"], f"rank {rank} {case} {spec}")


@pytest.mark.parametrize("spec", ["torch", *SPECS])
def test_multistep_matches_single_process_on_concatenated_batch(
    traces: list[dict[tuple[str, str], Trace]], spec: str
) -> None:
    for rank, by_run in enumerate(traces):
        _assert_same(by_run["multistep", spec], by_run["multistep", "single"], f"rank {rank} {spec}")


def test_rank_zero_state_reaches_every_rank(traces: list[dict[tuple[str, str], Trace]]) -> None:
    """Different seeds per rank: after wrapping, every rank starts from rank 0's parameters."""
    for case in ("seeds", "frozen"):
        for spec in SPECS:
            first = traces[0][case, spec]["initial"]
            for by_run in traces[1:]:
                for name, t in by_run[case, spec]["initial"].items():
                    torch.testing.assert_close(t, first[name], rtol=0, atol=0)


def test_unused_parameters_keep_no_gradient(traces: list[dict[tuple[str, str], Trace]]) -> None:
    """The torch DDP behaviour the suite relies on: a globally unused parameter's .grad stays None."""
    for by_run in traces:
        for spec in SPECS:
            assert all(step["never.weight"] is None for step in by_run["unused", spec]["grads"])
            assert by_run["unused", spec]["grads"][0]["a.weight"] is not None


def _behaviours(rank: int, world: int) -> dict[str, Any]:
    """Telemetry, errors, logging and bucket layout, observed inside a real process group."""
    seen: dict[str, Any] = {}
    x, y = _data(rank, 0)

    engine = BucketedDDP(_seeded(MLP, 0))
    _mse(engine, (x, y)).backward()
    stats = engine.comm_stats
    grad_bytes = sum(p.numel() * 4 for p in engine.parameters())
    seen["bytes"] = (stats.bytes_sent, all_reduce_bytes(grad_bytes, world))
    seen["times_positive"] = stats.collective_s > 0 and stats.exposed_s > 0
    with engine.no_sync():
        _mse(engine, (x, y)).backward()
    seen["kept_through_no_sync"] = engine.comm_stats is stats
    _mse(engine, (x, y)).backward()
    seen["fresh_after_sync"] = engine.comm_stats is not stats and engine.comm_stats.bytes_sent == stats.bytes_sent

    naive = NaiveDDP(_seeded(MLP, 0))
    _mse(naive, (x, y)).backward()
    seen["naive_all_exposed"] = naive.comm_stats.exposed_s >= naive.comm_stats.collective_s > 0

    view = BucketedDDP(_seeded(Wide, 0), bucket_cap_mb=0.01, gradient_as_bucket_view=True)
    _mse(view, (x, y)).backward()
    buffers = {b.buffer.untyped_storage().data_ptr() for b in view.reducer.buckets if b.buffer is not None}
    seen["grads_in_buckets"] = all(p.grad.untyped_storage().data_ptr() in buffers for p in view.parameters())
    seen["bucket_count"] = len(view.reducer.buckets)

    def launched_in_backward(engine: torch.nn.Module) -> int:
        """Collectives launched before backward's compute ended (both on the engine's clock)."""
        stats = engine.comm_stats
        compute_done = stats.clock.resolve([stats.exposed])[0][0]
        return sum(launch < compute_done for launch, _ in stats.clock.resolve(stats.spans))

    seen["launched_in_backward"] = {"bucketed": launched_in_backward(view), "naive": launched_in_backward(naive)}

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("ddptrain.engines.stream").addHandler(handler)
    StreamBucketedDDP(_seeded(MLP, 0))
    StreamBucketedDDP(_seeded(MLP, 0))
    seen["fallback_logs"] = [r.getMessage() for r in records]

    strict = NaiveDDP(_seeded(Branches, 0))
    try:
        F.mse_loss(strict(x, "a"), y).backward()
        seen["unused_error"] = None
    except RuntimeError as exc:
        seen["unused_error"] = str(exc)
    return seen


@pytest.fixture(scope="module")
def behaviours() -> list[dict[str, Any]]:
    return run_distributed(_behaviours, 2)


def test_comm_stats_count_bytes_and_time(behaviours: list[dict[str, Any]]) -> None:
    for seen in behaviours:
        sent, expected = seen["bytes"]
        assert sent == expected
        assert seen["times_positive"]
        assert seen["naive_all_exposed"]


def test_comm_stats_describe_the_last_synchronised_backward(behaviours: list[dict[str, Any]]) -> None:
    for seen in behaviours:
        assert seen["kept_through_no_sync"]
        assert seen["fresh_after_sync"]


def test_gradient_as_bucket_view_puts_grads_inside_bucket_buffers(behaviours: list[dict[str, Any]]) -> None:
    for seen in behaviours:
        assert seen["grads_in_buckets"]
        assert seen["bucket_count"] > 3


def test_an_overlapping_engine_launches_buckets_while_backward_still_computes(
    behaviours: list[dict[str, Any]],
) -> None:
    for seen in behaviours:
        assert seen["launched_in_backward"]["bucketed"] >= 1  # a bucket goes out as soon as it is ready
        assert seen["launched_in_backward"]["naive"] == 0  # the naive engine waits for the end: the check can fail


def test_stream_engine_says_once_that_it_runs_as_bucketed_on_cpu(behaviours: list[dict[str, Any]]) -> None:
    for seen in behaviours:
        assert len(seen["fallback_logs"]) == 1
        assert "running as the bucketed engine" in seen["fallback_logs"][0]


def test_unused_parameter_without_find_unused_is_an_error(behaviours: list[dict[str, Any]]) -> None:
    for seen in behaviours:
        assert seen["unused_error"] is not None
        assert "find_unused_parameters=True" in seen["unused_error"]
        assert "b.weight" in seen["unused_error"]


def test_buckets_fill_in_reverse_parameter_order_up_to_the_cap() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (256, 256, 256, 1024, 16)]  # 1 KB, 1 KB, 1 KB, 4 KB, 64 B
    assert assign_buckets(params, cap_bytes=2048) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(params, cap_bytes=None) == [[4], [3], [2], [1], [0]]
    mixed = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert assign_buckets(mixed, cap_bytes=1 << 20) == [[1], [0]]


def test_reachable_leaves_follow_structured_outputs() -> None:
    model = Structured()
    reach = reachable_leaves(model(torch.randn(2, 8)))
    assert {id(p) for p in model.parameters()} <= reach
    assert reachable_leaves({"only": (model.head(torch.randn(2, 8)),)}) == {id(model.head.weight), id(model.head.bias)}


def test_unknown_engine_or_collective_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parallel.engine='ring_bucketed': expected one of naive, overlap_sync"):
        build_engine("ring_bucketed", nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parallel.collective='tree': expected one of native, ring"):
        build_engine("bucketed", nn.Linear(2, 2), collective="tree")
