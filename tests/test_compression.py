"""Gradient compression hooks on 2 gloo ranks: exact bytes on the wire, averaged gradients, convergence, validation."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.comm.clock import ClockKind, CommClock
from ddptrain.config.compose import build_config
from ddptrain.config.schema import ParallelConfig
from ddptrain.errors import ConfigError
from ddptrain.parallel.compression import (
    CommMeter,
    CompressionState,
    _topk_hook,
    _TopKState,
    powersgd_elements,
    register_compression,
)
from ddptrain.parallel.wrap import EngineMeter, Wrapped, wrap_model
from tests.helpers.dist import run_distributed
from tests.helpers.in_process import OUTLIVING

IN, HIDDEN, OUT = 32, 64, 16
NUMEL = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 3152 parameters: one DDP bucket
FP32_BYTES = 4 * NUMEL
BYTE_CASES = {
    "none": ParallelConfig(),
    "fp16": ParallelConfig(compression="fp16"),
    "bf16": ParallelConfig(compression="bf16"),
    "powersgd": ParallelConfig(compression="powersgd", powersgd_start_iter=2),
    "topk": ParallelConfig(compression="topk"),
    "topk_all": ParallelConfig(compression="topk", topk_ratio=1.0),
}
CONVERGENCE_CASES = {
    "none": ParallelConfig(),
    "powersgd": ParallelConfig(compression="powersgd"),
    "topk": ParallelConfig(compression="topk"),
    "topk_no_feedback": ParallelConfig(compression="topk", error_feedback=False),
}



Keep = Callable[[Any], Any]


class CompletedWork:
    """What an async collective returns, already complete: its future holds the output tensor."""

    def __init__(self, out: torch.Tensor) -> None:
        self.fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self.fut.set_result([out])

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self.fut


@pytest.fixture
def one_rank_gloo() -> Iterator[Keep]:
    """A one-rank gloo group in this process for the test's length. The test hands what holds the group (a DDP)
    to the yielded ``keep``, which returns it and keeps it in ``OUTLIVING``."""
    import torch.distributed as dist

    def keep(holder: Any) -> Any:
        OUTLIVING.append(holder)
        return holder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield keep
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    """A two-layer linear network: both weights are matrices PowerSGD compresses, the biases it sends whole."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT))


def _batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy samples of a fixed random linear map: learnable, with a loss floor of 0.1² = 0.01."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(0)) / IN**0.5
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, IN, generator=gen)
    return x, x @ teacher + 0.1 * torch.randn(size, OUT, generator=gen)


def _sync_bytes(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Per case: bytes after a no_sync backward, (sent, uncompressed) per synced step, first step's gradients,
    each step's sync sample as the loop takes it."""
    out = {}
    for name, cfg in BYTE_CASES.items():
        ddp = DistributedDataParallel(_model())
        meter = register_compression(ddp, cfg).meter
        no_sync, steps, samples = [], [], []
        for step in range(3):
            x, y = _batch(100 * step + rank, 16)
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()
            no_sync.append(meter.comm_bytes)
            nn.functional.mse_loss(ddp(x), y).backward()
            steps.append((meter.comm_bytes, meter.uncompressed_bytes))
            if step == 0:
                grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
            samples.append(meter.take_sample(world_size, sampled=True)[0])  # resets the meter
            ddp.zero_grad()
        out[name] = {"no_sync": no_sync, "steps": steps, "grads": grads, "samples": samples}
    return out


def _final_losses(rank: int, world_size: int, steps: int) -> dict[str, float]:
    """Train each case with plain SGD on this rank's own data; return the loss on a shared held-out set."""
    x_eval, y_eval = _batch(seed=7, size=4096)
    losses = {}
    for name, cfg in CONVERGENCE_CASES.items():
        model = _model()
        ddp = DistributedDataParallel(model)
        meter = register_compression(ddp, cfg).meter
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            x, y = _batch(1000 + world_size * step + rank, 32)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            meter.reset()
        with torch.no_grad():
            losses[name] = nn.functional.mse_loss(model(x_eval), y_eval).item()
    return losses


@pytest.fixture(scope="module")
def sync_bytes() -> dict[str, dict[str, Any]]:
    ranks = run_distributed(_sync_bytes, 2)
    assert all(ranks[0][name]["steps"] == ranks[1][name]["steps"] for name in BYTE_CASES)
    return ranks[0]


@pytest.fixture(scope="module")
def final_losses() -> dict[str, float]:
    return run_distributed(_final_losses, 2, 300)[0]


def test_no_bytes_are_counted_under_no_sync(sync_bytes: dict) -> None:
    assert all(result["no_sync"] == [0, 0, 0] for result in sync_bytes.values())


def test_uncompressed_reference_is_the_fp32_bucket(sync_bytes: dict) -> None:
    assert all(u == FP32_BYTES for result in sync_bytes.values() for _, u in result["steps"])
    assert sync_bytes["none"]["steps"] == [(FP32_BYTES, FP32_BYTES)] * 3


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_half_precision_sends_exactly_half_and_averages(name: str, sync_bytes: dict) -> None:
    assert sync_bytes[name]["steps"] == [(FP32_BYTES // 2, FP32_BYTES)] * 3
    torch.testing.assert_close(sync_bytes[name]["grads"], sync_bytes["none"]["grads"], rtol=1e-2, atol=1e-3)


def test_topk_sends_values_and_int32_indices_under_4_percent(sync_bytes: dict) -> None:
    expected = (4 + 4) * math.ceil(0.01 * NUMEL)
    assert sync_bytes["topk"]["steps"] == [(expected, FP32_BYTES)] * 3
    assert expected / FP32_BYTES <= 0.04


@pytest.mark.parametrize("world_size", [1, 2])
def test_topk_sends_int64_indices_only_in_a_bucket_too_long_for_int32_positions(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket of 2**31 elements or more has positions an int32 cannot hold: its indices go as int64 (12 bytes per
    entry sent), a bucket one element shorter sends int32 (8 bytes). The buckets are on the meta device (shapes,
    no memory) and the all-gather answers at once (meta: shapes only, nothing to gather). One rank
    (``parallel.wrap_single``) too: there the gathered row's index part is already contiguous, at a byte offset of
    4 × k (k = 3 here), which an int64 view cannot take without a copy."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "all_gather_single", lambda out, inp, group=None, async_op=False: CompletedWork(out))
    sent = {}
    for numel in (2**31 - 1, 2**31):
        buffer = torch.empty(numel, device="meta")
        bucket = SimpleNamespace(buffer=lambda b=buffer: b, parameters=list, gradients=list)
        state = _TopKState(None, CommMeter(CommClock(ClockKind.host)), ratio=1e-9, error_feedback=False)
        averaged = _topk_hook(state, bucket).wait()  # type: ignore[arg-type]
        assert averaged.shape == (numel,)
        sent[numel] = state.meter.comm_bytes
    k = math.ceil(1e-9 * 2**31)
    assert k == math.ceil(1e-9 * (2**31 - 1)) == 3
    assert sent == {2**31 - 1: (4 + 4) * k, 2**31: (4 + 8) * k}


def test_topk_of_everything_is_the_exact_average(sync_bytes: dict) -> None:
    torch.testing.assert_close(sync_bytes["topk_all"]["grads"], sync_bytes["none"]["grads"])


def test_powersgd_sends_m_plus_n_times_rank_per_matrix_after_warmup(sync_bytes: dict) -> None:
    rank = ParallelConfig().powersgd_rank
    compressed = 4 * ((HIDDEN + IN) * rank + HIDDEN + (OUT + HIDDEN) * rank + OUT)  # biases: too small to compress
    assert sync_bytes["powersgd"]["steps"] == [(FP32_BYTES, FP32_BYTES)] * 2 + [(compressed, FP32_BYTES)]


def test_the_first_steps_line_gives_what_powersgd_sends_not_its_plain_warm_up_steps(
    sync_bytes: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """PowerSGD all-reduces plainly until parallel.powersgd_start_iter (2 here): the first step's line, from that
    step's sample, says what a compressed step sends (the comm_bytes logged later), and what the warm-up sends."""
    import ddptrain.train.first_step as first_step

    rank = ParallelConfig().powersgd_rank
    compressed = 4 * ((HIDDEN + IN) * rank + HIDDEN + (OUT + HIDDEN) * rank + OUT)
    warm_up, later = sync_bytes["powersgd"]["samples"][0], sync_bytes["powersgd"]["samples"][2]
    assert (warm_up.payload_bytes, later.payload_bytes) == (FP32_BYTES, compressed)  # the step did send it all
    monkeypatch.setattr(first_step, "report_model_state", lambda *args: {})
    monkeypatch.setattr(first_step, "shard_group_size", lambda *args: 1)
    cfg = SimpleNamespace(train=SimpleNamespace(compile=False), parallel=SimpleNamespace(zero_stage=0))
    t = SimpleNamespace(start=0, device=torch.device("cpu"), cfg=cfg, env=SimpleNamespace(world_size=2,
                        local_world_size=2), trainable=NUMEL, n_params=NUMEL,
                        probe=SimpleNamespace(after_step=lambda optimizer: None), optimizer=None, precision=None)
    lines = {}
    for name, sample in (("powersgd", warm_up), ("none", sync_bytes["none"]["samples"][0])):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ddptrain"):
            first_step.FirstStep(t).after_step(1, sample, log_step=True)
        lines[name] = caplog.messages[-1]
    assert lines["powersgd"] == (f"3.15K of 3.15K trainable; {compressed / 1e6:.3g} MB all-reduced per step "
                                 f"({FP32_BYTES / 1e6:.3g} MB on the steps before the compression starts)")
    assert lines["none"] == f"3.15K of 3.15K trainable; {FP32_BYTES / 1e6:.3g} MB all-reduced per step"


def test_error_feedback_keeps_compressed_runs_within_2_percent(final_losses: dict[str, float]) -> None:
    assert final_losses["powersgd"] <= 1.02 * final_losses["none"]
    assert final_losses["topk"] <= 1.02 * final_losses["none"]


def test_topk_without_error_feedback_is_at_least_twice_as_bad(final_losses: dict[str, float]) -> None:
    assert final_losses["topk_no_feedback"] >= 2 * final_losses["none"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"compression": "int8"}, "parallel.compression='int8'"),
        ({"compression": "powersgd", "powersgd_rank": 0}, "parallel.powersgd_rank=0"),
        ({"compression": "powersgd", "powersgd_start_iter": 1}, "parallel.powersgd_start_iter=1"),
        (
            {"compression": "powersgd", "powersgd_start_iter": 1, "error_feedback": False},
            "parallel.powersgd_start_iter=1",  # warm start keeps per-bucket state too
        ),
        ({"compression": "topk", "topk_ratio": 0.0}, "parallel.topk_ratio=0.0"),
        ({"compression": "topk", "topk_ratio": 1.5}, "parallel.topk_ratio=1.5"),
    ],
)
def test_bad_settings_fail_naming_the_key(override: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}"):
        build_config({"parallel": override})


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "powersgd", "topk"])
def test_default_settings_are_valid(compression: str) -> None:
    assert build_config({"parallel": {"compression": compression}}).parallel.compression == compression


def test_the_meter_adds_each_buckets_bytes_and_its_sample_gives_payload_spans_and_launches() -> None:
    """In-process: what the hooks charge (``record``) and what a sampled step reads back (``take_sample``)."""
    meter = CommMeter(CommClock(ClockKind.host))
    meter.record(100, torch.zeros(50))  # sent 100 of a 200-byte fp32 bucket
    meter.record(30, torch.zeros(10, dtype=torch.float64), steady_bytes=8)  # a warm-up bucket: 8 once compressing
    assert (meter.comm_bytes, meter.uncompressed_bytes, meter.steady_bytes) == (130, 280, 108)
    meter.spans += [(1.0, 2.0), (1.5, 4.0)]
    meter.launches += [(1.0, 200), (1.5, 80)]
    assert meter.timing() == (3.0, 2.5)  # in flight 1.0 to 4.0; exposed from the last launch (1.5) to the end
    sample, ratio = meter.take_sample(2, sampled=True)
    assert ratio == 130 / 280 and sample is not None
    assert (sample.payload_bytes, sample.comm_s, sample.exposed_s, sample.steady_bytes) == (130, 3.0, 2.5, 108)
    assert sample.buckets == ((0.5, 200), (0.0, 80))
    assert (meter.comm_bytes, meter.uncompressed_bytes, meter.spans, meter.launches) == (0, 0, [], [])
    again, ratio = meter.take_sample(2, sampled=True)  # nothing since: reset
    assert ratio == 1.0 and again is not None and (again.payload_bytes, again.buckets) == (0, ())


def test_the_wrapped_model_reads_its_meter_and_drops_error_feedback_through_its_compression_state() -> None:
    """In-process: what the loop asks of ``Wrapped`` after a step, with and without a meter and a hook's state,
    and our engines' meter (a 2-rank all-reduce's link bytes 2(N-1)/N x S = S back to the payload S)."""
    model = nn.Linear(2, 2)
    meter = CommMeter(CommClock(ClockKind.host))
    dropped: list[bool] = []
    feedback = SimpleNamespace(discard_if=lambda nonfinite: dropped.append(bool(nonfinite)))
    wrapped = Wrapped(model, model, lambda _sync: None, meter, "torch DDP", CompressionState(meter, feedback))
    meter.record(8, torch.zeros(4))
    sample, ratio = wrapped.take_sync_sample(2, sampled=True)
    assert sample is not None and sample.payload_bytes == 8 and ratio == 0.5
    assert wrapped.take_sync_sample(2, sampled=False) == (None, 1.0)  # not sampled: the ratio only
    assert wrapped.comm_clock() is meter.clock
    wrapped.step_done(torch.tensor(True))
    assert dropped == [True]
    bare = Wrapped(model, model, lambda _sync: None, None, "none")
    assert bare.take_sync_sample(2, sampled=True) == (None, None) and bare.comm_clock() is None
    bare.step_done(torch.tensor(True))  # no hook state: nothing to drop
    stats = SimpleNamespace(bytes_sent=400, in_flight_s=0.5, exposed_s=0.25, clock=meter.clock)
    engine = EngineMeter(SimpleNamespace(comm_stats=stats))
    assert engine.take_sample(2, sampled=False) == (None, None)
    taken, none = engine.take_sample(2, sampled=True)
    assert none is None and taken is not None and (taken.payload_bytes, taken.comm_s, taken.exposed_s) == (
        400, 0.5, 0.25)
    assert engine.clock is meter.clock


@pytest.mark.parametrize(("compression", "dtype", "bytes_per_element"), [
    ("none", torch.float32, 4), ("fp16", torch.float16, 2), ("bf16", torch.bfloat16, 2)])
def test_each_hook_is_installed_in_this_process_and_sends_its_dtype(
        compression: str, dtype: torch.dtype, bytes_per_element: int, one_rank_gloo: Keep) -> None:
    """``register_compression`` on a 1-rank DDP in the test process (gloo): the hook the setting names charges the
    meter it returns, and the gradient comes back rounded through the dtype it sends."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    ddp = one_rank_gloo(DistributedDataParallel(layer))
    state = register_compression(ddp, ParallelConfig(compression=compression))
    x = torch.randn(4, 8)
    ddp(x).pow(2).sum().backward()
    reference = nn.Linear(8, 8)
    reference.load_state_dict(layer.state_dict())
    reference(x).pow(2).sum().backward()
    assert state.feedback is None and state.meter.comm_bytes == 72 * bytes_per_element
    assert state.meter.uncompressed_bytes == 72 * 4 and len(state.meter.spans) == 1
    ((start, end),) = state.meter.spans  # the hook's span on the meter's clock, as the overlap figure reads it
    assert start <= end
    for got, want in zip(layer.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad.to(dtype).float())


@pytest.mark.parametrize("compression", ["powersgd", "topk"])
def test_a_hook_that_keeps_state_returns_it_for_the_skipped_steps(compression: str, one_rank_gloo: Keep) -> None:
    ddp = one_rank_gloo(DistributedDataParallel(nn.Linear(8, 8)))
    state = register_compression(ddp, ParallelConfig(compression=compression, error_feedback=True))
    ddp(torch.randn(4, 8)).sum().backward()
    assert state.feedback is not None and state.feedback.meter is state.meter and state.meter.comm_bytes > 0
    if compression == "topk":
        assert state.feedback.error_feedback and len(state.feedback.residuals) == 2
    else:
        assert state.feedback.powersgd.process_group is None


def test_powersgd_charges_a_plain_all_reduce_in_warm_up_then_torchs_own_tally_once_it_compresses(
        one_rank_gloo: Keep) -> None:
    """PowerSGD on a 1-rank DDP in the test process, compressing from step 2: the two warm-up steps are charged
    the whole bucket (1,056 fp32 elements: a 32x32 weight and its bias) and report the steady figure, 288 elements
    (the weight as (32+32)x4 factors, the bias whole); the compressed step is charged what torch's
    ``compression_stats`` tally added, the same 288."""
    torch.manual_seed(0)
    ddp = one_rank_gloo(DistributedDataParallel(nn.Linear(32, 32)))
    state = register_compression(ddp, ParallelConfig(compression="powersgd", powersgd_start_iter=2,
                                                     error_feedback=False))
    charged = []
    for _ in range(3):
        before = (state.meter.comm_bytes, state.meter.steady_bytes)
        ddp(torch.randn(4, 32)).pow(2).sum().backward()
        charged.append((state.meter.comm_bytes - before[0], state.meter.steady_bytes - before[1]))
    assert charged == [(1056 * 4, 288 * 4), (1056 * 4, 288 * 4), (288 * 4, 288 * 4)]
    assert state.feedback is not None and state.feedback.powersgd.compression_stats()[2] == 288


def test_topk_drops_every_residual_after_a_non_finite_step_and_keeps_them_after_a_finite_one(
        one_rank_gloo: Keep) -> None:
    """The top-k state's residuals (what was not sent) are zeroed on the device when the step's verdict is
    non-finite, every one of them, and kept as they are otherwise."""
    ddp = one_rank_gloo(DistributedDataParallel(nn.Linear(8, 8)))
    state = register_compression(ddp, ParallelConfig(compression="topk", error_feedback=True))
    ddp(torch.randn(4, 8)).pow(2).sum().backward()
    residuals = list(state.feedback.residuals.values())
    kept = [r.clone() for r in residuals]
    assert len(residuals) == 2 and any(bool(r.abs().sum() > 0) for r in residuals)
    state.feedback.discard_if(torch.tensor(False))
    assert all(torch.equal(r, k) for r, k in zip(residuals, kept, strict=True))
    state.feedback.discard_if(torch.tensor(True))
    assert all(bool((r == 0).all()) for r in residuals)


def test_one_rank_trains_the_bare_model_unless_wrap_single_and_says_so(
        caplog: pytest.LogCaptureFixture, one_rank_gloo: Keep) -> None:
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.INFO):
        bare = one_rank_gloo(wrap_model(model, ParallelConfig(), torch.device("cpu")))
        wrapped = one_rank_gloo(wrap_model(nn.Linear(2, 2), ParallelConfig(wrap_single=True), torch.device("cpu")))
    assert bare.outer is model and bare.model is model and (bare.strategy, bare.meter) == ("none", None)
    assert isinstance(wrapped.outer, DistributedDataParallel) and wrapped.strategy == "torch DDP"
    assert caplog.messages == ["data parallel: none (world size 1: the bare model, no gradient sync; "
                               "parallel.wrap_single=true wraps it)", "data parallel: torch DDP"]


def test_powersgd_elements_sends_the_factors_of_a_matrix_worth_compressing_and_any_other_whole() -> None:
    powersgd = SimpleNamespace(matrix_approximation_rank=2, min_compression_rate=2)
    # (64 + 32) x 2 = 192 factors, 192 x 2 < 2048: compressed; (3 + 2) x 2 = 10, 10 x 2 >= 6: sent whole (6)
    assert powersgd_elements(powersgd, [torch.zeros(64, 32), torch.zeros(3, 2)]) == 192 + 6
    assert powersgd_elements(powersgd, [torch.zeros(64, 2, 16)]) == 192  # viewed as 64 rows


# Top-k on 3 ranks. Each rank trains a one-output linear layer without bias on one sample: its weight's gradient is
# the sample itself, so each rank chooses what top-k (2 of 4 entries) sends. Index 0 collides on every rank with
# values whose sum depends on the order: in rank order 1e8 - 1e8 + 1 = 1, while 1e8 + 1 rounds to 1e8 in fp32.
TOPK_SAMPLES = [[1e8, 0.0, 0.25, 0.0], [-1e8, 0.0, 0.0, 0.125], [1.0, 0.5, 0.0, 0.0]]


def _rank_order_reference() -> torch.Tensor:
    """Each rank's two largest entries added into zeros, rank 0 first, one fp32 addition at a time; then the mean."""
    total = torch.zeros(4)
    for sample in TOPK_SAMPLES:
        row = torch.tensor(sample)
        for i in row.abs().topk(2).indices.tolist():
            total[i] = total[i] + row[i]
    return total / len(TOPK_SAMPLES)


class _ScatterAdds(TorchDispatchMode):
    """Records every op that adds values at indices: where indices collide, CUDA adds in any order."""

    ADDS = frozenset({"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                      "index_reduce", "index_reduce_", "put", "put_", "embedding_dense_backward"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        accumulate = kwargs.get("accumulate", args[3] if name in ("index_put", "index_put_", "_index_put_impl_")
                                and len(args) > 3 else False)
        if name in self.ADDS or accumulate:
            self.seen.append(name)
        return func(*args, **kwargs)


def _completed_all_gathers() -> None:
    """Make ``dist.all_gather_single`` finish before it returns its work: a future that is already complete runs
    the hook's decompression at once, in the calling thread, where a dispatch mode sees its ops (a pending
    future's callback runs later in gloo's own thread, which no mode of this thread watches)."""
    import torch.distributed as dist

    gather = dist.all_gather_single

    def completed(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> CompletedWork:
        gather(out, inp, group=group)
        return CompletedWork(out)

    dist.all_gather_single = completed


def _topk_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """The top-k sum of colliding indices under deterministic algorithms (and what adds at indices), then a finite
    step and one whose rank-1 loss is NaN, with each rank's residuals after each."""
    torch.use_deterministic_algorithms(True)
    _completed_all_gathers()
    layer = nn.Linear(4, 1, bias=False)
    ddp = DistributedDataParallel(layer)
    register_compression(ddp, ParallelConfig(compression="topk", topk_ratio=0.5, error_feedback=False))
    with _ScatterAdds() as adds:
        ddp(torch.tensor([TOPK_SAMPLES[rank]])).sum().backward()
    out: dict[str, Any] = {"grad": layer.weight.grad.flatten().clone(), "scatter_adds": adds.seen}

    ddp = DistributedDataParallel(_model())
    compression = register_compression(ddp, ParallelConfig(compression="topk"))
    residuals = compression.feedback.residuals  # type: ignore[union-attr]
    for step, poison in enumerate((1.0, math.nan if rank == 1 else 1.0)):
        x, y = _batch(10 * step + rank, 8)
        (nn.functional.mse_loss(ddp(x), y) * poison).backward()
        norm = torch.cat([p.grad.flatten() for p in ddp.parameters()]).norm()
        out[f"residuals_{step}"] = [r.clone() for r in residuals.values()]
        compression.step_done(~torch.isfinite(norm))
        out[f"kept_{step}"] = [r.clone() for r in residuals.values()]
        ddp.zero_grad()
    return out


@pytest.fixture(scope="module")
def topk_ranks() -> list[dict[str, Any]]:
    return run_distributed(_topk_ranks, 3)


def test_topk_sums_colliding_indices_in_rank_order_bitwise_alike_on_every_rank(topk_ranks: list[dict]) -> None:
    reference = _rank_order_reference()
    assert reference[0] == torch.tensor(1.0) / 3  # the order matters: any other order gives 0 here
    for rank in topk_ranks:
        assert torch.equal(rank["grad"], reference), (rank["grad"], reference)


def test_topk_adds_no_values_at_indices_with_a_scatter_add(topk_ranks: list[dict]) -> None:
    """index_add_ and its kin add colliding indices in any order on CUDA (torch's documentation): not used."""
    assert [rank["scatter_adds"] for rank in topk_ranks] == [[], [], []]


def test_a_skipped_step_zeroes_every_residual_entry_on_every_rank(topk_ranks: list[dict]) -> None:
    for rank in topk_ranks:
        finite = rank["kept_0"]  # a finite step keeps what it did not send
        assert finite and all(torch.isfinite(r).all() and r.count_nonzero() > 0 for r in finite)
    # rank 0 and 2 kept finite residuals from the skipped step, rank 1 non-finite ones: all are dropped alike
    assert all(torch.isfinite(r).all() for rank in (0, 2) for r in topk_ranks[rank]["residuals_1"])
    assert not all(torch.isfinite(r).all() for r in topk_ranks[1]["residuals_1"])
    for rank in topk_ranks:
        assert all(torch.equal(r, torch.zeros_like(r)) for r in rank["kept_1"])


def test_torch_ddp_gets_the_bucket_size_static_graph_and_bucket_view_of_the_config(one_rank_gloo: Keep) -> None:
    cfg = ParallelConfig(wrap_single=True, bucket_cap_mb=1.5, static_graph=True, gradient_as_bucket_view=True)
    ddp = one_rank_gloo(wrap_model(nn.Linear(4, 4), cfg, torch.device("cpu"))).outer
    assert isinstance(ddp, DistributedDataParallel)
    assert (ddp.bucket_bytes_cap, ddp.static_graph, ddp.gradient_as_bucket_view) == (int(1.5 * 2**20), True, True)


def test_an_engine_wraps_the_model_and_its_no_sync_skips_the_gradient_sync(
        caplog: pytest.LogCaptureFixture, one_rank_gloo: Keep) -> None:
    model = nn.Linear(4, 4)
    with caplog.at_level(logging.INFO):
        wrapped = one_rank_gloo(wrap_model(model, ParallelConfig(wrap_single=True, engine="bucketed"),
                                           torch.device("cpu")))
    assert wrapped.model is model and wrapped.outer.module is model and isinstance(wrapped.meter, EngineMeter)
    assert caplog.messages == ["data parallel: engine bucketed"]
    with wrapped.maybe_sync(False):
        assert not wrapped.outer.require_backward_grad_sync
    with wrapped.maybe_sync(True):
        assert wrapped.outer.require_backward_grad_sync


def test_zero_stage_2_shards_the_model_with_fsdp2_and_says_so(
        caplog: pytest.LogCaptureFixture, one_rank_gloo: Keep) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with caplog.at_level(logging.INFO):
        wrapped = one_rank_gloo(wrap_model(model, ParallelConfig(wrap_single=True, zero_stage=2), torch.device("cpu")))
    assert wrapped.outer is model and isinstance(model, FSDPModule) and wrapped.model is model
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert (wrapped.strategy, wrapped.meter) == ("FSDP2 (ZeRO-2)", None)
    assert caplog.messages == ["data parallel: FSDP2 (ZeRO-2)"]
