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


def _variants() -> dict[str, tuple[str, dict[str, str], dict[str, object]]]:
    """name -> (kernel, signature, compile-time constants) of every variant the tests read."""
    import triton.language as tl

    cast = {"src": "*fp32", "dst": "*bf16", "n": "i64", "scale": "fp32", "seed": "i32"}
    copy = {**TABLE_ARGS, "scale": "fp32", "scale_ptr": "*fp32"}
    square = {**TABLE_ARGS, "partials": "*fp32"}
    variants: dict[str, tuple[str, dict[str, str], dict[str, object]]] = {
        "to_bf16": ("_to_bf16_kernel", cast, {"STOCHASTIC": False, "BLOCK": 2048}),
        "to_bf16_stochastic": ("_to_bf16_kernel", cast, {"STOCHASTIC": True, "BLOCK": 2048}),
        "from_bf16": ("_from_bf16_kernel", {"src": "*bf16", "dst": "*fp32", "n": "i64", "scale": "fp32"},
                      {"BLOCK": 2048}),
        "sum": ("_sum_kernel", {"partials": "*fp32", "n": "i32", "out": "*fp32"}, {"BLOCK": 1024}),
    }
    for dtype, vec in ((tl.float32, 4), (tl.bfloat16, 8)):
        for v, kind in ((vec, "aligned"), (1, "unaligned")):
            for scale in (0, 2):  # no scale (packing) | the device coefficient (the clip)
                variants[f"copy_{dtype}_{kind}_scale{scale}"] = (
                    "_copy_kernel", copy, {"DTYPE": dtype, "SCALE": scale, "STRIDED": False, "VEC": v, "BLOCK": 2048})
            variants[f"square_{dtype}_{kind}"] = (
                "_square_sum_kernel", square, {"DTYPE": dtype, "STRIDED": False, "VEC": v, "BLOCK": 2048})
    return variants


def emit() -> None:
    """In a fresh interpreter without ``TRITON_INTERPRET``: print every variant's PTX as one JSON object."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ddptrain.kernels import triton_ops

    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, (kernel, signature, constants) in _variants().items():
        fn = getattr(triton_ops, kernel)
        pointers = {(i,): ALIGNED for i, arg in enumerate(signature) if signature[arg].startswith("*")}
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                           constexprs=constants, attrs=pointers)
        out[name] = triton.compile(source, target=target).asm["ptx"]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")),
               TRITON_DEFAULT_FP_FUSION="1")
    code = "from tests.test_kernels_ptx import emit; emit()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _accesses(ptx: str) -> set[str]:
    """The kinds of global loads and stores in ``ptx``, e.g. ``ld.global.v4.b32``."""
    return set(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)+", ptx))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_table_kernels_on_aligned_rows_load_and_store_16_byte_vectors(ptx: dict[str, str], dtype: str) -> None:
    for scale in (0, 2):
        aligned, unaligned = ptx[f"copy_{dtype}_aligned_scale{scale}"], ptx[f"copy_{dtype}_unaligned_scale{scale}"]
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= _accesses(aligned), _accesses(aligned)
        # the variant for unaligned rows cannot vectorize: it is the one the hints make the difference against
        assert not any(".v" in a for a in _accesses(unaligned)), _accesses(unaligned)
    assert "ld.global.v4.b32" in _accesses(ptx[f"square_{dtype}_aligned"])
    assert not any(".v" in a for a in _accesses(ptx[f"square_{dtype}_unaligned"]))


def _first_use_of_program_id(ptx: str) -> str:
    """The first instruction that reads the register holding the program id (``%ctaid.x``)."""
    register = re.search(r"mov\.u32\s+(%r\d+),\s*%ctaid\.x;", ptx)
    assert register, "no program id in the kernel"
    uses = re.finditer(rf"^\s*(\S+)\s[^;]*{re.escape(register.group(1))}\b[^;]*;", ptx[register.end():], re.M)
    first = next(uses, None)
    assert first, "the program id is never used"
    return first.group(0).strip()


@pytest.mark.parametrize("kernel", ["to_bf16", "to_bf16_stochastic", "from_bf16"])
def test_cast_kernels_compute_offsets_in_64_bits_from_the_program_id(ptx: dict[str, str], kernel: str) -> None:
    """A bucket over 2^31 elements: the program id times the block must be widened before it can overflow."""
    use = _first_use_of_program_id(ptx[kernel])
    assert re.match(r"(mul\.wide\.[su]32|cvt\.[su]64\.[su]32)\s", use), use


def test_the_squared_norm_reduces_in_a_fixed_order_on_the_gpu(ptx: dict[str, str]) -> None:
    """Determinism by construction: each program writes its own partial, one program sums them in a loop; no
    atomic (whose order the GPU's scheduler picks) in either kernel. Triton's interpreter runs programs one after
    another, so a run there cannot show this."""
    for name in ("square_fp32_aligned", "square_fp32_unaligned", "square_bf16_aligned", "sum"):
        assert not re.search(r"\b(atom|red)\.", ptx[name]), f"{name} accumulates with atomics"
