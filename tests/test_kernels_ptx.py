"""The Triton kernels as the GPU compiler emits them: PTX for an H100 (sm_90), compiled on this CPU-only machine.

The interpreter that runs the kernels in the other tests checks their arithmetic, not what the compiler makes of
them: whether accesses are 16-byte vectors, whether offsets are 64-bit, whether a reduction uses atomics. The
kernels are compiled in a fresh interpreter, because this pytest process has ``TRITON_INTERPRET=1`` set (an
interpreted kernel cannot be compiled). Arguments carry the alignment Triton's launcher gives a torch
allocation (16-byte-divisible pointers).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ALIGNED = [["tt.divisibility", 16]]
TABLE_ARGS = {"table": "*i64", "chunks": "*i64"}


Variant = tuple[str, dict[str, str], dict[str, object], tuple[str, ...]]


def _variants() -> dict[str, Variant]:
    """name -> (kernel, signature, compile-time constants, the integer arguments that are multiples of 16) of
    every variant the tests read. Triton's launcher marks an integer argument divisible by 16 when it is, so a
    cast of a bucket whose size is not is the variant without the mark on ``n``."""
    import triton.language as tl

    cast = {"src": "*fp32", "dst": "*bf16", "n": "i64", "scale": "fp32", "seed": "i32"}
    widen = {"src": "*bf16", "dst": "*fp32", "n": "i64", "scale": "fp32"}
    copy = {**TABLE_ARGS, "scale": "fp32", "scale_ptr": "*fp32"}
    square = {**TABLE_ARGS, "partials": "*fp32"}
    variants: dict[str, Variant] = {
        "sum": ("_sum_kernel", {"partials": "*fp32", "n": "i32", "out": "*fp32"}, {"BLOCK": 1024}, ()),
    }
    variants["to_bf16_stochastic"] = ("_to_bf16_kernel", cast, {"STOCHASTIC": True, "BLOCK": 2048}, ())
    for size, even in (("", ()), ("_n16", ("n",))):  # any size | a multiple of 16
        variants["to_bf16" + size] = ("_to_bf16_kernel", cast, {"STOCHASTIC": False, "BLOCK": 2048}, even)
        variants["from_bf16" + size] = ("_from_bf16_kernel", widen, {"BLOCK": 2048}, even)
    for dtype, vec in ((tl.float32, 4), (tl.bfloat16, 8)):
        # aligned: every address and size a multiple of 16 bytes | odd: aligned addresses, some size is not |
        # unaligned: some address is not | strided. Only the aligned copy is compiled with both scale modes (no
        # scale: packing; the device coefficient: the clip); each variant costs seconds of compiling.
        for v, even, strided, kind, scales in ((vec, True, False, "aligned", (0, 2)), (vec, False, False, "odd", (0,)),
                                               (1, False, False, "unaligned", (0,)), (1, False, True, "strided", (0,))):
            layout = {"STRIDED": strided, "VEC": v, "EVEN": even, "BLOCK": 2048}
            for scale in scales:
                variants[f"copy_{dtype}_{kind}_scale{scale}"] = (
                    "_copy_kernel", copy, {"DTYPE": dtype, "SCALE": scale, **layout}, ())
            if kind != "strided" or dtype == tl.float32:
                variants[f"square_{dtype}_{kind}"] = ("_square_sum_kernel", square, {"DTYPE": dtype, **layout}, ())
    return variants


def emit() -> None:
    """In a fresh interpreter without ``TRITON_INTERPRET``: print, as one JSON object, what our launches pass to
    Triton's compile step (``tests/helpers/triton_launch.py``; first, so that nothing before it has compiled)
    and every variant's PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.helpers.triton_launch import probe_launches

    launches = probe_launches()
    from ddptrain.kernels import triton_ops

    def ptx_is_the_end(*args: object) -> tuple[str, str] | None:
        """Triton's pipeline with its last stage, ptxas (PTX to a cubin), left out: the tests read the PTX, which
        comes before it unchanged (the same bytes with and without it). ptxas was 2.1-2.8 of this process's 9.5-12
        CPU s. Called without arguments, the hook names itself for Triton's cache key."""
        if not args:
            return "ptx-only", "ptx-only"
        stages = args[1]
        assert isinstance(stages, dict) and "ptx" in stages and "cubin" in stages, stages
        stages["cubin"] = lambda src, metadata: b""  # no binary: nothing here loads or launches one
        return None

    triton.knobs.runtime.add_stages_inspection_hook = ptx_is_the_end
    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, (kernel, signature, constants, multiples) in _variants().items():
        fn = getattr(triton_ops, kernel)
        attrs = {(i,): ALIGNED for i, arg in enumerate(signature) if signature[arg].startswith("*") or arg in multiples}
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                           constexprs=constants, attrs=attrs)
        # the options every launch passes (FP fusion chosen, not left to Triton's default)
        out[name] = triton.compile(source, target=target, options=triton_ops.LAUNCH_OPTIONS).asm["ptx"]
    print(json.dumps({"launches": launches, "ptx": out}))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``emit``'s output, with no FP-fusion setting in the environment."""
    unset = ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    code = "from tests.test_kernels_ptx import emit; emit()"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def ptx(compiled: dict) -> dict[str, str]:
    return compiled["ptx"]


def _accesses(ptx: str) -> set[str]:
    """The kinds of global loads and stores in ``ptx``, e.g. ``ld.global.v4.b32``."""
    return set(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)+", ptx))


def _scalar(ptx: str) -> set[str]:
    """The global loads and stores of data narrower than 16 bytes, leaving out the 8-byte table reads."""
    return {a for a in _accesses(ptx) if ".v" not in a and a != "ld.global.b64"}


VECTORS = {"ld.global.v4.b32", "st.global.v4.b32"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_table_kernels_on_aligned_rows_load_and_store_16_byte_vectors(ptx: dict[str, str], dtype: str) -> None:
    """Aligned rows: vectors only. Aligned addresses with an odd size: whole chunks are vectors (unmasked), the
    chunk that ends a tensor is masked element by element."""
    for scale in (0, 2):
        aligned = ptx[f"copy_{dtype}_aligned_scale{scale}"]
        # all vectors but the clip's coefficient (one scalar load)
        assert _accesses(aligned) >= VECTORS and _scalar(aligned) <= ({"ld.global.b32"} if scale else set())
        assert not {a for a in _scalar(aligned) if a.startswith("st.")}, _accesses(aligned)
    odd, unaligned = ptx[f"copy_{dtype}_odd_scale0"], ptx[f"copy_{dtype}_unaligned_scale0"]
    assert _accesses(odd) >= VECTORS and _scalar(odd), _accesses(odd)
    # the variant for unaligned rows cannot vectorize: it is the one the hints make the difference against
    assert not any(".v" in a for a in _accesses(unaligned)), _accesses(unaligned)
    assert "ld.global.v4.b32" in _accesses(ptx[f"square_{dtype}_aligned"])
    assert "ld.global.v4.b32" in _accesses(ptx[f"square_{dtype}_odd"])
    assert not any(".v" in a for a in _accesses(ptx[f"square_{dtype}_unaligned"]))


@pytest.mark.parametrize("kernel", ["to_bf16", "from_bf16"])
def test_cast_kernels_load_and_store_16_byte_vectors_whatever_the_bucket_size(ptx: dict[str, str],
                                                                              kernel: str) -> None:
    """A DDP bucket's size is the sum of its parameters' sizes, a multiple of 16 or not. Every block but the last
    is whole and unmasked, so its fp32 loads and bf16 stores (or the reverse) are 16-byte vectors either way;
    only the last block of a size that is not a multiple of 16 is masked element by element."""
    any_size, multiple = ptx[kernel], ptx[f"{kernel}_n16"]
    assert _accesses(any_size) >= VECTORS, _accesses(any_size)
    assert _accesses(multiple) >= VECTORS and not _scalar(multiple), _accesses(multiple)
    assert _accesses(ptx["to_bf16_stochastic"]) >= VECTORS  # stochastic rounding: the same accesses


@pytest.mark.parametrize("kernel", ["copy_fp32_strided_scale0", "square_fp32_strided", "copy_bf16_strided_scale0"])
def test_strided_kernels_divide_in_32_bits(ptx: dict[str, str], kernel: str) -> None:
    """A 64-bit division or remainder is a long emulated sequence per element on a GPU; the strided offsets carry
    each element's index from its chunk's first element in 32 bits (that index comes from the chunk table)."""
    divisions = re.findall(r"\b(?:div|rem)\.[su](?:32|64)\b", ptx[kernel])
    assert divisions, "no division left: the strided variant was not compiled"
    assert not [d for d in divisions if d.endswith("64")], sorted(set(divisions))


def test_the_squared_norm_rounds_each_square_on_its_own(ptx: dict[str, str]) -> None:
    """Every launch passes ``enable_fp_fusion=False``: no multiply-add fuses x * x into the sum, as in the
    interpreter and in torch, and Triton 3.10 flipping its default changes no bit. (With fusion on, the same
    kernel compiles to 16 ``fma.rn.f32`` per thread, and to ``mul.f32``/``add.f32`` that ptxas may contract.)"""
    for name in ("square_fp32_aligned", "square_fp32_odd", "square_fp32_strided"):
        assert "mul.rn.f32" in ptx[name], "no explicitly rounded multiply"
        assert not re.search(r"\bfma\.|\b(?:mul|add)\.f32\b", ptx[name]), f"{name} may fuse its squares into the sum"


def _first_use_of_program_id(ptx: str) -> str:
    """The first instruction that reads the register holding the program id (``%ctaid.x``)."""
    register = re.search(r"mov\.u32\s+(%r\d+),\s*%ctaid\.x;", ptx)
    assert register, "no program id in the kernel"
    uses = re.finditer(rf"^\s*(\S+)\s[^;]*{re.escape(register.group(1))}\b[^;]*;", ptx[register.end():], re.M)
    first = next(uses, None)
    assert first, "the program id is never used"
    return first.group(0).strip()


@pytest.mark.parametrize("kernel", ["to_bf16", "to_bf16_stochastic", "from_bf16", "to_bf16_n16"])
def test_cast_kernels_compute_offsets_in_64_bits_from_the_program_id(ptx: dict[str, str], kernel: str) -> None:
    """A bucket over 2^31 elements: the program id times the block must be widened before it can overflow."""
    use = _first_use_of_program_id(ptx[kernel])
    assert re.match(r"(mul\.wide\.[su]32|cvt\.[su]64\.[su]32)\s", use), use


def test_the_squared_norm_reduces_in_a_fixed_order_on_the_gpu(ptx: dict[str, str]) -> None:
    """Determinism by construction: each program writes its own partial, one program sums them in a loop; no
    atomic (whose order the GPU's scheduler picks) in either kernel. Triton's interpreter runs programs one after
    another, so a run there cannot show this."""
    for name in ("square_fp32_aligned", "square_fp32_unaligned", "square_bf16_aligned", "square_fp32_strided", "sum"):
        assert not re.search(r"\b(atom|red)\.", ptx[name]), f"{name} accumulates with atomics"


def test_every_launch_chooses_fp_fusion_so_triton_warns_nothing_on_any_rank(compiled: dict) -> None:
    """Triton 3.9 warns, once per process (so once per rank), at the first launch that leaves FP fusion to its
    default, which 3.10 changes. Every launch passes ``enable_fp_fusion=False``: the launches reach Triton's
    compile step with fusion off and no warning, with nothing set in the environment."""
    probe = compiled["launches"]
    kernels = {name for name, _ in probe["reached"]}
    assert kernels == {"_copy_kernel", "_square_sum_kernel", "_sum_kernel", "_to_bf16_kernel", "_from_bf16_kernel"}
    assert all(fusion is False for _, fusion in probe["reached"]), probe["reached"]
    assert probe["warnings"] == [], probe["warnings"]
