"""The fused kernels equal their torch references, run through Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` must be set before Triton compiles anything, hence at the very top of this module:
ddptrain imports Triton only when its kernels are chosen.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.app.cli import run_cli as ddptrain_main
from ddptrain.config.choices import Kernels
from ddptrain.config.compose import build_config
from ddptrain.errors import ConfigError
from ddptrain.kernels import TORCH_KERNELS, check_kernels, select_kernels
from ddptrain.kernels import triton_ops as ops
from ddptrain.kernels.clip import clip_grad_norm
from ddptrain.kernels.fallback import FallbackKernels, FirstLaunchError
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each
from tests.helpers.tiny import TINY_MODEL

TRITON = select_kernels("triton", torch.device("cpu"))
SIZES = [1, 7, 1023, 1025, 10**6 + 3]


def _sources() -> list[torch.Tensor]:
    """Odd sizes, an empty tensor, and non-contiguous views (transposed, sliced with steps, expanded)."""
    g = torch.Generator().manual_seed(0)
    return [
        *(torch.randn(n, generator=g) for n in SIZES),
        torch.empty(0),
        torch.randn(24, 40, generator=g).t(),
        torch.randn(5, 9, 7, generator=g)[1:, ::2, 2:],
        torch.randn(3, 1, 5, generator=g).expand(3, 4, 5),
        torch.randn(2, 3, 4, 5, 6, generator=g).transpose(0, 4)[:, ::2],  # 5 dimensions that do not coalesce
    ]


def _bucket(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.full((sum(t.numel() for t in tensors),), float("nan"))
    return flat, [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


class _Launches:
    """Counts launches of a kernel (a jit function indexed by its grid) and keeps their grids and arguments."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.count, self.grids, self.constants = kernel, 0, [], []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        self.count += 1
        self.grids.append(grid)

        def launch(*args: Any, **constants: Any) -> Any:
            self.constants.append(constants)
            return self.kernel[grid](*args, **constants)

        return launch


KERNELS = ["_copy_kernel", "_square_sum_kernel", "_sum_kernel", "_to_bf16_kernel", "_from_bf16_kernel"]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Launches]:
    """Every Triton kernel, counted: a comparison with torch proves something only if Triton's kernels ran."""
    counted = {name: _Launches(getattr(ops, name)) for name in KERNELS}
    for name, counter in counted.items():
        monkeypatch.setattr(ops, name, counter)
    return counted


def _launched(launches: dict[str, _Launches]) -> dict[str, int]:
    return {name: c.count for name, c in launches.items() if c.count}


@pytest.fixture(scope="module")
def sources() -> list[torch.Tensor]:
    return _sources()


def test_the_triton_kernels_under_test_are_tritons() -> None:
    assert TRITON.name == "triton" and type(TRITON).__module__ == ops.__name__


def _kinds(tensors: list[torch.Tensor]) -> int:
    """Launches a list takes: one per dtype and addressing (contiguous or strided) among the kernels' tensors."""
    return len({(t.dtype, t.is_contiguous()) for t in tensors if t.numel() and t.dtype in ops.TL_DTYPES})


def test_pack_and_unpack_are_bitwise_copies_in_one_launch_per_addressing(sources: list[torch.Tensor],
                                                                         launches: dict[str, _Launches]) -> None:
    """Contiguous pairs launch apart from strided ones: one transposed gradient does not put a whole bucket on
    strided addressing (nor off vector accesses)."""
    flat, views = _bucket(sources)
    TRITON.copy_(views, sources)
    assert _launched(launches) == {"_copy_kernel": 2}
    assert [c["STRIDED"] for c in launches["_copy_kernel"].constants] == [False, True]
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in sources]))
    back = [torch.empty_like(t) for t in sources]
    back[6] = torch.empty(24, 40).t()  # a strided destination too
    TRITON.copy_(back, views)
    assert _launched(launches) == {"_copy_kernel": 4}
    for got, want in zip(back, sources, strict=True):
        assert torch.equal(got, want)


def test_strided_tensors_over_many_chunks_copy_bitwise_from_chunks_that_start_mid_dimension(
    launches: dict[str, _Launches],
) -> None:
    """A strided chunk starts from its first element's index over the sizes (from the chunk table) and carries
    each element's offset from it in 32 bits: chunks past the first start inside every dimension here."""
    g = torch.Generator().manual_seed(5)
    src = torch.randn(63, 48, 70, generator=g)[:, ::2].transpose(0, 2)  # 105,840 elements: two interpreter chunks
    dst = torch.empty(70, 63, 24).transpose(1, 2)  # strided the other way
    TRITON.copy_([dst], [src])
    assert _launched(launches) == {"_copy_kernel": 1} and launches["_copy_kernel"].constants[0]["STRIDED"]
    assert launches["_copy_kernel"].grids[0] == (2,)
    assert torch.equal(dst, src)
    torch.testing.assert_close(TRITON.squared_norm([src]), TORCH_KERNELS.squared_norm([src]), rtol=1e-6, atol=0)


def test_a_strided_tensor_whose_sizes_pass_the_32_bit_index_math_goes_to_torch() -> None:
    """The strided index math is 32-bit; a dimension near 2^31 elements (an expanded tensor: no memory) is left
    to torch, a smaller one is the kernels'."""
    huge, small = torch.empty(1).expand(2**31), torch.empty(1).expand(2**20)
    assert ops._groups([(huge, huge)]) == ({}, [(huge, huge)])
    assert list(ops._groups([(small, small)])[0]) == [(torch.float32, True)]


def test_five_hundred_tensors_pack_in_one_launch(launches: dict[str, _Launches]) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(0, 300, (500,), generator=g)]
    flat, views = _bucket(tensors)
    TRITON.copy_(views, tensors)
    assert _launched(launches) == {"_copy_kernel": 1}
    assert torch.equal(flat, torch.cat(tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_average_fused_with_unpack_matches_torch_within_one_ulp(sources: list[torch.Tensor], dtype: torch.dtype,
                                                                launches: dict[str, _Launches]) -> None:
    summed = [t.to(dtype) for t in sources[1:]]  # up to 1025 elements: the large size runs in fp32 below
    if dtype == torch.float32:
        summed = [t.to(dtype) for t in sources]
    got, want = [torch.empty_like(t) for t in summed], [torch.empty_like(t) for t in summed]
    TRITON.copy_(got, summed, 1 / 3)
    assert _launched(launches) == {"_copy_kernel": _kinds(summed)}
    TORCH_KERNELS.copy_(want, summed, 1 / 3)
    for g, w in zip(got, want, strict=True):
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(g, w, rtol=ulp, atol=torch.finfo(dtype).tiny)


def test_average_in_place_when_the_gradient_is_the_bucket_view(sources: list[torch.Tensor],
                                                               launches: dict[str, _Launches]) -> None:
    flat, views = _bucket(sources)
    TRITON.copy_(views, sources)
    TRITON.copy_(views, views, 0.5)  # destination == source: each element read, then written, by one program
    assert _launched(launches) == {"_copy_kernel": 3}  # the sources' contiguous and strided launches, then one
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in sources]) * 0.5)


def test_squared_norm_is_within_1e6_of_torch_and_summed_by_one_program(sources: list[torch.Tensor],
                                                                       launches: dict[str, _Launches]) -> None:
    """Its determinism on a GPU is by construction: one partial per program, summed by a single program in a
    loop (checked here) and no atomics (checked in the emitted PTX, tests/test_kernels_ptx.py). Rerunning it
    here would show nothing: the interpreter runs programs one after another."""
    g = torch.Generator().manual_seed(2)
    many = [torch.randn(int(n), generator=g) for n in torch.randint(0, 300, (500,), generator=g)]
    half = [torch.randn(1025, generator=g).to(torch.bfloat16), torch.randn(7, generator=g).half()]
    for tensors in (sources, many, [*many[:5], *half], [torch.ones(1)]):
        before = launches["_square_sum_kernel"].count
        got = TRITON.squared_norm(tensors)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, TORCH_KERNELS.squared_norm(tensors), rtol=1e-6, atol=0)
        assert launches["_square_sum_kernel"].count - before == _kinds(tensors)
        assert launches["_sum_kernel"].grids[-1] == (1,)
    assert torch.equal(TRITON.squared_norm([torch.empty(0)]), torch.tensor(0.0))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_equals_torch_clip_grad_norm(sources: list[torch.Tensor], max_norm: float,
                                          launches: dict[str, _Launches]) -> None:
    def params() -> list[torch.nn.Parameter]:
        made = [torch.nn.Parameter(torch.zeros(t.shape)) for t in sources[:4]] + [torch.nn.Parameter(torch.zeros(3))]
        for p, t in zip(made[:4], sources[:4], strict=True):
            p.grad = t.clone()  # the last parameter has no gradient
        return made

    ours, theirs = params(), params()
    norm = clip_grad_norm(ours, max_norm, "triton")
    assert _launched(launches) == {"_square_sum_kernel": 1, "_sum_kernel": 1, "_copy_kernel": 1}
    assert launches["_copy_kernel"].constants[0]["SCALE"] == ops.SCALE_DEVICE  # the clip's scaling pass
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, max_norm), rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)
    assert torch.equal(clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0, "triton"), torch.tensor(0.0))


def test_norm_only_leaves_gradients_untouched(sources: list[torch.Tensor], launches: dict[str, _Launches]) -> None:
    params = [torch.nn.Parameter(torch.zeros(t.shape)) for t in sources[:4]]
    for p, t in zip(params, sources[:4], strict=True):
        p.grad = t.clone()
    norm = clip_grad_norm(params, None, "triton")
    assert _launched(launches) == {"_square_sum_kernel": 1, "_sum_kernel": 1}  # no scaling pass
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(sources[:4]), rtol=1e-6, atol=0)
    assert all(torch.equal(p.grad, t) for p, t in zip(params, sources[:4], strict=True))


def _special_values() -> torch.Tensor:
    """Ties at every rounding boundary, infinities, the largest finite values, subnormals, signed zeros."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_FFFF, 0xFF7F_FFFF, 0x0000_8000,
                         0x0001_8000, 0x8000_0000, 0x7F7F_7FFF], dtype=torch.int64)
    special = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(3)
    return torch.cat([special, torch.tensor([0.0, math.inf, -math.inf]), torch.randn(10**6 + 3, generator=g) * 1e3])


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_fp32_to_bf16_rounds_to_nearest_even_bitwise(scale: float, launches: dict[str, _Launches]) -> None:
    x = _special_values()
    got, want = torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.bfloat16)
    TRITON.cast_(got, x, scale)
    TORCH_KERNELS.cast_(want, x, scale)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    back, back_want = torch.empty_like(x), torch.empty_like(x)
    TRITON.cast_(back, got, 0.5)
    assert _launched(launches) == {"_to_bf16_kernel": 1, "_from_bf16_kernel": 1}
    TORCH_KERNELS.cast_(back_want, got, 0.5)
    assert torch.equal(back, back_want)
    nan = torch.tensor([math.nan])
    out = torch.empty(1, dtype=torch.bfloat16)
    TRITON.cast_(out, nan)
    assert out.isnan().all()  # NaN stays NaN (its payload bits differ between torch's own CPU and CUDA paths)


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(launches: dict[str, _Launches]) -> None:
    x = torch.full((200_000,), 1.0 + 2**-9 + 2**-11)  # between the bf16 neighbours 1 and 1 + 2^-7, 5/16 up
    x[:7] = torch.tensor([0.0, -1.5, math.inf, -math.inf, 3.0, 2**-130, 7.25])
    out, again, other = (torch.empty_like(x, dtype=torch.bfloat16) for _ in range(3))
    TRITON.cast_(out, x, stochastic=True, seed=11)
    TRITON.cast_(again, x, stochastic=True, seed=11)
    TRITON.cast_(other, x, stochastic=True, seed=12)
    assert _launched(launches) == {"_to_bf16_kernel": 3}
    assert all(c["STOCHASTIC"] for c in launches["_to_bf16_kernel"].constants)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    assert not torch.equal(out.view(torch.int16), other.view(torch.int16))
    body = out[7:].float()
    assert set(body.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(body.mean().item() - x[7].item()) < 1e-4  # unbiased: the mean lands on x (std of mean ~1e-5)
    assert torch.equal(out[:7].float()[[0, 1, 2, 3, 4]], x[:5])  # representable values stay exact
    reference = torch.empty_like(out)
    TORCH_KERNELS.cast_(reference, x, stochastic=True, seed=11)
    assert abs(reference[7:].float().mean().item() - x[7].item()) < 1e-4


def test_auto_runs_triton_on_cuda_only_and_triton_where_it_cannot_run_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert select_kernels("auto", torch.device("cpu")) is TORCH_KERNELS
    assert select_kernels("torch", torch.device("cpu")) is TORCH_KERNELS
    with pytest.raises(ConfigError, match="interpreter cannot run on CUDA tensors"):
        check_kernels("triton", "cuda")
    assert select_kernels("auto", torch.device("cuda")) is TORCH_KERNELS  # the interpreter is on: not for CUDA
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_kernels("auto", torch.device("cuda")).name == "triton"
    with pytest.raises(ConfigError, match=r"parallel.kernels=triton cannot run here: Triton compiles for CUDA"):
        check_kernels("triton", "cpu")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="Triton is not installed"):
        check_kernels("triton", "cuda")
    assert select_kernels("auto", torch.device("cuda")) is TORCH_KERNELS


def test_rows_aligned_to_16_bytes_take_the_vector_variant_and_give_the_same_bits(
    launches: dict[str, _Launches],
) -> None:
    """The variant the compiler vectorizes (tests/test_kernels_ptx.py) is chosen when every address is a multiple
    of 16 bytes; sizes that are too (``EVEN``) make each tensor's last chunk vectors as well. An odd size keeps
    the vector variant for whole chunks; one unaligned address keeps the whole launch on the scalar variant."""
    g = torch.Generator().manual_seed(4)
    aligned = [torch.randn(n, generator=g) for n in (8, 64, 4096 + 8)]  # multiples of 16 bytes in fp32 and bf16
    for dtype, vec in ((torch.float32, 4), (torch.bfloat16, 8)):
        srcs = [t.to(dtype) for t in aligned]
        flat = torch.empty(sum(t.numel() for t in srcs), dtype=dtype)
        views = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in srcs]), srcs, strict=True)]
        TRITON.copy_(views, srcs)
        assert torch.equal(flat, torch.cat(srcs))
        assert launches["_copy_kernel"].constants[-1]["VEC"] == vec and launches["_copy_kernel"].constants[-1]["EVEN"]
        TRITON.squared_norm(views)
        assert launches["_square_sum_kernel"].constants[-1]["VEC"] == vec
    odd = [torch.empty(3), torch.empty(5000)]  # 12 bytes: an odd size, at an aligned address of its own
    TRITON.copy_(odd, [torch.ones(3), torch.full((5000,), 2.0)])
    assert (launches["_copy_kernel"].constants[-1]["VEC"], launches["_copy_kernel"].constants[-1]["EVEN"]) == (4, False)
    assert torch.equal(odd[0], torch.ones(3)) and torch.equal(odd[1], torch.full((5000,), 2.0))
    flat = torch.zeros(3 + 8)
    TRITON.copy_([flat[:3], flat[3:]], [torch.ones(3), torch.ones(8)])  # the second view starts 12 bytes in
    assert launches["_copy_kernel"].constants[-1]["VEC"] == 1 and torch.equal(flat, torch.ones(11))


def test_address_tables_reach_the_gpu_from_pinned_memory_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy from pageable memory waits for the stream (a host sync per launch); a non-blocking one from pinned
    memory does not. CPU-only torch can pin nothing, so pinning and the copy are recorded instead of done."""
    pinned: set[int] = set()
    copies: list[tuple[bool, str, bool]] = []

    def pin_memory(self: torch.Tensor) -> torch.Tensor:
        out = self.clone()
        pinned.add(id(out))
        return out

    def to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        copies.append((id(self) in pinned, str(device), non_blocking))
        return self

    pairs = [(torch.ones(5), torch.empty(5)), (torch.ones(3, 4).t(), torch.empty(4, 3))]
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    plain, strided = ops._table(pairs[:1], torch.device("cuda", 0)), ops._table(pairs[1:], torch.device("cuda", 0))
    monkeypatch.undo()
    assert copies == [(True, "cuda:0", True)] * 2
    assert plain.rows.tolist()[:3] == [pairs[0][0].data_ptr(), pairs[0][1].data_ptr(), 5] and not plain.strided
    assert strided.strided and strided.sizes == ((1, 1, 4, 3),)


class _NoCompiler:
    """A kernel whose launch fails as Triton's first launch does in an image without a C compiler."""

    def __init__(self) -> None:
        self.attempts = 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **constants: Any) -> None:
            self.attempts += 1
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

        return launch


def test_auto_goes_on_with_torchs_kernels_after_one_warning_when_tritons_first_launch_fails(
    sources: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    failing = {name: _NoCompiler() for name in KERNELS}
    for name, kernel in failing.items():
        monkeypatch.setattr(ops, name, kernel)
    kernels = FallbackKernels(ops.TritonKernels(), TORCH_KERNELS)  # a fresh process: no launch has succeeded
    assert kernels.name == "triton"
    got, want = [torch.empty_like(t) for t in sources], [torch.empty_like(t) for t in sources]
    with caplog.at_level(logging.WARNING):
        kernels.copy_(got, sources, 0.5)
        assert kernels.active is TORCH_KERNELS and kernels.name == "torch"
        kernels.scale_(got, torch.tensor(0.25))
        norm = kernels.squared_norm(got)
        half = torch.empty(1025, dtype=torch.bfloat16)
        kernels.cast_(half, sources[3])
    TORCH_KERNELS.copy_(want, sources, 0.5)
    TORCH_KERNELS.scale_(want, torch.tensor(0.25))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(norm, TORCH_KERNELS.squared_norm(want))
    assert torch.equal(half, sources[3].to(torch.bfloat16))
    assert sum(k.attempts for k in failing.values()) == 1, "Triton was tried again after its first launch failed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "parallel.kernels=auto: Triton's first kernel launch failed" in warnings[0]
    assert "Failed to find C compiler" in warnings[0] and "torch's kernels" in warnings[0]


def test_a_failed_launch_is_an_error_under_triton_or_after_a_launch_has_succeeded(
    sources: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh = ops.TritonKernels()
    proven = FallbackKernels(ops.TritonKernels(), TORCH_KERNELS)
    proven.copy_([torch.empty(3)], [torch.ones(3)])  # a launch succeeds: the launcher builds
    monkeypatch.setattr(ops, "_copy_kernel", _NoCompiler())
    with pytest.raises(FirstLaunchError, match=r"Triton's first kernel launch failed .*C compiler"):
        fresh.copy_([torch.empty(3)], [torch.ones(3)])  # parallel.kernels=triton: no fallback
    with pytest.raises(RuntimeError, match="C compiler") as raised:
        proven.copy_([torch.empty(3)], [torch.ones(3)])
    assert not isinstance(raised.value, FirstLaunchError) and proven.name == "triton"


def test_auto_on_cuda_is_one_fallback_shared_by_every_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines, the clip and the bf16 hook select their kernels apart: one fallback switches them all."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    auto = select_kernels("auto", torch.device("cuda"))
    assert isinstance(auto, FallbackKernels) and auto is select_kernels("auto", torch.device("cuda"))
    assert not isinstance(select_kernels("triton", torch.device("cuda")), FallbackKernels)


def test_kernels_key_is_typed_with_its_choices() -> None:
    assert build_config({"parallel": {"kernels": "triton"}}).parallel.kernels == Kernels.triton
    assert build_config().parallel.kernels == "auto"
    with pytest.raises(Exception, match=r"auto, triton, torch"):
        build_config({"parallel": {"kernels": "cuda"}})


def test_triton_kernels_on_a_cpu_without_the_interpreter_is_a_one_line_startup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    start = time.monotonic()
    code = ddptrain_main(["parallel.kernels=triton", "data.max_documents=20"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err[-1].startswith("ddptrain: error: parallel.kernels=triton cannot run here: Triton compiles for CUDA")
    assert time.monotonic() - start < 30


LOOP = {
    "model": TINY_MODEL,
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 64, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 2, "log_every": 1, "eval_every": 0},
    "optim": {"grad_clip": 0.5},
}


def train_counting_launches(rank: int, world_size: int, tmp: str, base: dict, variants: list[dict]) -> list[dict]:
    """For ``run_distributed``: ``train_each``, one variant at a time, with this rank's launches of every Triton
    kernel counted per variant (by kernel, and the copy kernel's by scaling mode)."""
    original = {name: getattr(ops, name) for name in KERNELS}
    results = []
    for i, variant in enumerate(variants):
        counters = {name: _Launches(kernel) for name, kernel in original.items()}
        for name, counter in counters.items():
            setattr(ops, name, counter)
        [result] = train_each(rank, world_size, str(Path(tmp) / f"variant{i}"), base, [variant])
        result["launches"] = {name: c.count for name, c in counters.items()}
        result["copy_scales"] = sorted({c["SCALE"] for c in counters["_copy_kernel"].constants})
        results.append(result)
    for name, kernel in original.items():
        setattr(ops, name, kernel)
    return results


def test_training_loop_on_triton_kernels_tracks_torch(tmp_path: Path) -> None:
    """Two ranks through the real loop: our bucketed engine, the clip step and the bf16 hook on Triton's kernels
    (interpreted) give the losses and gradient norms of the torch path, and Triton's kernels did the work on
    every rank (``parallel.kernels=torch`` launches none)."""
    variants = [
        {"parallel": {"engine": engine, "compression": compression, "kernels": kernels}}
        for engine, compression in (("bucketed", "none"), ("torch", "bf16"))
        for kernels in ("torch", "triton")
    ]
    by_rank = run_distributed(train_counting_launches, 2, str(tmp_path), LOOP, variants)
    steps = LOOP["train"]["steps"]
    for runs in by_rank:
        assert all(count == 0 for run in (runs[0], runs[2]) for count in run["launches"].values())
        bucketed, hooked = runs[1]["launches"], runs[3]["launches"]
        # the engine packs (no scale) and unpacks with the average (a host scale) every step; the clip scales
        assert bucketed["_copy_kernel"] >= 3 * steps and runs[1]["copy_scales"] == [0, 1, 2]
        assert hooked["_to_bf16_kernel"] >= steps and hooked["_from_bf16_kernel"] >= steps  # the bf16 hook
        assert runs[3]["copy_scales"] == [2]  # torch's DDP buckets; only the clip's scaling is ours
        for launches in (bucketed, hooked):
            assert launches["_square_sum_kernel"] == steps and launches["_sum_kernel"] == steps  # the clip's norm
    runs = by_rank[0]
    for torch_run, triton_run in (runs[0:2], runs[2:4]):
        for want, got in zip(torch_run["metrics"], triton_run["metrics"], strict=True):
            assert got["grad_norm"] > 0.5  # clipping was active
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_auto_clips_with_torchs_kernels_even_where_it_would_pick_tritons(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H100 the fused norm + clip took 1.6-2.7x torch's time at every size (docs/benchmarks.md), so
    ``parallel.kernels=auto`` clips with torch's; ``triton`` still asks for the fused kernels."""
    import ddptrain.kernels.clip as clip_module

    asked: list[str] = []
    select = clip_module.select_kernels
    monkeypatch.setattr(clip_module, "select_kernels",
                        lambda mode, device: asked.append(mode) or select("triton", device))  # Triton's, as on CUDA
    params = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    torch.testing.assert_close(clip_grad_norm(params, 1.0, "auto"), torch.tensor(math.sqrt(60.0)))
    assert asked == []  # torch's own clip_grad_norm_, never the fused pair
    clip_grad_norm(params, 1.0, "triton")
    assert asked == ["triton"]
