"""The compiled Triton kernels on a CUDA device equal their torch references (``pytest -m gpu``).

The checks run in a fresh interpreter: ``tests/test_kernels.py`` sets ``TRITON_INTERPRET=1`` for this whole
pytest process, and interpreted kernels cannot read CUDA memory.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)


def check_compiled_kernels(device_type: str = "cuda") -> None:
    """Pack/unpack and casts bitwise, the average within an ulp, the norm within 1e-6, the clip as torch's.

    (``device_type="cpu"`` with ``TRITON_INTERPRET=1`` runs the same checks through the interpreter.)"""
    from ddptrain.kernels import TORCH_KERNELS, select_kernels
    from ddptrain.kernels.clip import clip_grad_norm

    device = torch.device(device_type)
    fused = select_kernels("triton", device)
    assert fused.name == "triton"
    g = torch.Generator(device=device).manual_seed(0)
    sources = [torch.randn(n, device=device, generator=g) for n in (1, 7, 1023, 1025, 10**6 + 3, 0)]
    sources += [torch.randn(24, 40, device=device, generator=g).t(), torch.randn(5, 9, 7, device=device)[1:, ::2]]
    many = torch.randint(0, 300, (500,), generator=g, device=device).tolist()
    sources += [torch.randn(n, device=device, generator=g) for n in many]
    flat = torch.empty(sum(t.numel() for t in sources), device=device)
    views = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in sources]), sources, strict=True)]
    fused.copy_(views, sources)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in sources]))
    got, want = [torch.empty_like(t) for t in sources], [torch.empty_like(t) for t in sources]
    fused.copy_(got, views, 1 / 3)
    TORCH_KERNELS.copy_(want, views, 1 / 3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=torch.finfo(torch.float32).eps, atol=0)
    norm = fused.squared_norm(sources)
    torch.testing.assert_close(norm, TORCH_KERNELS.squared_norm(sources), rtol=1e-6, atol=0)
    assert torch.equal(norm, fused.squared_norm(sources))
    x = torch.cat([sources[4] * 1e3, torch.tensor([0.0, math.inf, -math.inf, 3.4e38], device=device)])
    down, down_want = (torch.empty_like(x, dtype=torch.bfloat16) for _ in range(2))
    fused.cast_(down, x, 1 / 3)
    TORCH_KERNELS.cast_(down_want, x, 1 / 3)
    assert torch.equal(down.view(torch.int16), down_want.view(torch.int16))
    up, up_want = torch.empty_like(x), torch.empty_like(x)
    fused.cast_(up, down, 0.5)
    TORCH_KERNELS.cast_(up_want, down, 0.5)
    assert torch.equal(up, up_want)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in sources[:4]]
    reference = [torch.nn.Parameter(torch.zeros_like(t)) for t in sources[:4]]
    for p, q, t in zip(params, reference, sources, strict=False):
        p.grad, q.grad = t.clone(), t.clone()
    torch.testing.assert_close(clip_grad_norm(params, 0.5, "triton"), torch.nn.utils.clip_grad_norm_(reference, 0.5),
                               rtol=1e-6, atol=0)
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-12)
    if device.type == "cuda":
        # Once a layout's chunk table is cached, no launch waits for the device: address tables travel from
        # pinned memory without blocking, so a synchronizing call here raises.
        half = torch.tensor(0.5, device=device)  # a copy from the host's pageable memory: synchronizes, so before
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused.copy_(views, sources)
            fused.copy_(got, views, 1 / 3)
            fused.squared_norm(sources)
            fused.scale_(got, half)
            fused.cast_(down, x, 1 / 3)
            fused.cast_(up, down, 0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    odd = [torch.empty_like(t) for t in got]
    fused.copy_(odd, got)  # aligned addresses, odd sizes: vector accesses but in each tensor's masked last chunk
    assert all(torch.equal(a, b) for a, b in zip(odd, got, strict=True))
    # a strided tensor over many chunks, each starting mid-dimension: the 32-bit carried index of each element
    strided = torch.randn(63, 48, 70, device=device, generator=g)[:, ::2].transpose(0, 2)
    out = torch.empty(70, 63, 24, device=device).transpose(1, 2)
    fused.copy_([out], [strided])
    assert torch.equal(out, strided)
    aligned = [torch.randn(n, device=device, generator=g) for n in (8, 4096, 10**6 + 8)]
    flat = torch.empty(sum(t.numel() for t in aligned), device=device)
    views = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in aligned]), aligned, strict=True)]
    fused.copy_(views, aligned)  # the vectorized variant: every row 16-byte aligned
    assert torch.equal(flat, torch.cat(aligned))
    torch.testing.assert_close(fused.squared_norm(views), TORCH_KERNELS.squared_norm(aligned), rtol=1e-6, atol=0)


def test_compiled_kernels_match_torch_on_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    code = "from tests.test_kernels_gpu import check_compiled_kernels; check_compiled_kernels()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
