"""Our Triton kernels launched through Triton's own JIT path up to compilation, on a machine without a GPU.

``probe_launches`` runs in a fresh interpreter without ``TRITON_INTERPRET``. A stand-in driver answers Triton's
questions about the current device (device 0, stream 0, an H100: ``sm_90``), so ``kernel[grid](...)`` binds its
arguments, parses its options (where Triton 3.9 warns about FP fusion) and reaches its compile step; a
``jit_cache_hook`` records each launch's options there and returns True, which tells Triton to skip compiling,
so nothing runs.
It returns the kernels reached with their ``enable_fp_fusion``, and every warning raised. The hook is removed
afterwards and the stand-in driver stays (a machine without a GPU has no other), so the same process can go on
compiling for an explicit target (``tests/test_kernels_ptx.py``).
"""

from __future__ import annotations

import json
import warnings
from typing import Any


class SM90Driver:
    """What ``JITFunction.run`` asks of the active driver before it compiles."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def probe_launches() -> dict[str, list]:
    import torch
    import triton
    from triton.runtime.driver import driver

    reached: list[tuple[str, bool]] = []

    def record(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        reached.append((fn.name, compile["enable_fp_fusion"]))
        return True  # skip compiling: nothing is launched

    driver.set_active(SM90Driver())
    triton.knobs.runtime.jit_cache_hook = record
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from ddptrain.kernels.triton_ops import TritonKernels

            kernels = TritonKernels()
            x = torch.randn(1000)
            kernels.copy_([torch.empty(1000)], [x], 0.5)
            kernels.scale_([torch.empty(10, 3).t()], torch.tensor(0.5))
            kernels.cast_(torch.empty(1000, dtype=torch.bfloat16), x)
            kernels.cast_(torch.empty(1000), torch.empty(1000, dtype=torch.bfloat16))
            kernels.squared_norm([x])
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    return {"reached": reached, "warnings": [str(w.message) for w in caught]}


def main() -> None:
    print(json.dumps(probe_launches()))


if __name__ == "__main__":
    main()
