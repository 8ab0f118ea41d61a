"""Measure each fused kernel against the torch sequence it replaces, on one CUDA device, in one run.

    python scripts/bench_kernels.py                       # CUDA: sizes 1 MB .. 1 GB, 9 interleaved repeats
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --smoke   # CPU: checks the script runs (times mean nothing)

For each size (bytes of fp32 gradients, split over ``--tensors`` tensors of uneven sizes) and each operation it
times the torch sequence and the fused kernel, interleaved in every repeat, and prints (markdown) the medians,
the speed-up (median of per-repeat ratios), the fused kernel's bandwidth (the bytes it must move / its time)
and that bandwidth as a share of the device's peak memory bandwidth (``--peak-gbps``, or a table of devices).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddptrain.kernels import TorchKernels, select_kernels

WORLD = 8  # the world size the averaging divides by
MB = 1 << 20
# Peak HBM bandwidth in GB/s by device name (vendor data sheets), matched by substring, most specific first.
PEAK_GBPS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
             ("A100-PCIE-80GB", 1935.0), ("A100", 1555.0), ("L40S", 864.0), ("A10", 600.0), ("L4", 300.0)]


@dataclass
class Case:
    """One operation at one size: the torch sequence, the fused kernel, and the bytes the fused kernel moves."""

    name: str
    torch_fn: Callable[[], object]
    fused_fn: Callable[[], object]
    bytes_moved: int


def _sizes(total_bytes: int, count: int, align: int = 1) -> list[int]:
    """``count`` uneven tensor sizes (weights next to biases and norms) summing to ``total_bytes`` of fp32, each a
    multiple of ``align`` elements (4: every row 16-byte aligned, the table kernels' vectorized variant)."""
    weights = [1 + (i % 7) * 97 for i in range(count)]
    elements = total_bytes // 4
    sizes = [elements * w // sum(weights) // align * align for w in weights]
    sizes[0] += elements - sum(sizes)
    return sizes


def cases(total_bytes: int, count: int, device: torch.device) -> list[Case]:
    """Every fused path in ddptrain next to the torch ops it replaces, on ``total_bytes`` of gradients; the
    table kernels twice: on uneven sizes (scalar accesses) and on sizes that keep every row 16-byte aligned."""
    fused = select_kernels("triton", device)
    grads = [torch.randn(n, device=device) for n in _sizes(total_bytes, count)]
    flat = torch.empty(sum(g.numel() for g in grads), device=device)
    compressed = torch.empty_like(flat, dtype=torch.bfloat16)
    d = flat.numel()
    aligned = [torch.randn(n, device=device) for n in _sizes(total_bytes, count, align=4)]
    return [
        *_table_cases(fused, grads, flat, ""),
        *_table_cases(fused, aligned, torch.empty_like(flat), ", aligned rows"),
        Case("fp32 -> bf16, / world", lambda: flat.to(torch.bfloat16).div_(WORLD),  # the bf16 hook before
             lambda: fused.cast_(compressed, flat, 1 / WORLD), 6 * d),
        Case("bf16 -> fp32", lambda: flat.copy_(compressed), lambda: fused.cast_(flat, compressed), 6 * d),
    ]


def _table_cases(fused: TorchKernels, grads: list[torch.Tensor], flat: torch.Tensor, label: str) -> list[Case]:
    """Pack, unpack + average and the clip on ``grads`` (bucket ``flat``), the kernels that read address tables."""
    views = list(flat.split([g.numel() for g in grads]))
    d = flat.numel()

    def pack_torch() -> None:  # the engines before: one copy per gradient as it becomes ready
        for view, grad in zip(views, grads, strict=True):
            view.copy_(grad)

    def unpack_torch() -> None:  # pre-divide the bucket, then copy each view back
        flat.div_(WORLD)
        for grad, view in zip(grads, views, strict=True):
            grad.copy_(view)

    def clip_torch() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    def clip_fused() -> None:
        total = fused.squared_norm(grads).sqrt()
        fused.scale_(grads, (1.0 / (total + 1e-6)).clamp(max=1.0))

    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.empty_like(grad))
        param.grad = grad
        params.append(param)
    return [
        Case(f"pack (copy into bucket){label}", pack_torch, lambda: fused.copy_(views, grads), 2 * 4 * d),
        Case(f"unpack + average{label}", unpack_torch, lambda: fused.copy_(grads, views, 1 / WORLD), 2 * 4 * d),
        Case(f"norm + clip{label}", clip_torch, clip_fused, 3 * 4 * d),
    ]


def seconds_per_call(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Seconds per call, over ``iters`` calls (device time on CUDA, by events)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iters


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--tensors", type=int, default=200, help="gradients per bucket (uneven sizes)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's memory bandwidth")
    parser.add_argument("--smoke", action="store_true", help="CPU through Triton's interpreter, 1 MB, 1 repeat")
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    if args.smoke:
        args.sizes_mb, args.repeats, args.tensors = [1], 1, 20
    elif not torch.cuda.is_available():
        raise SystemExit("bench_kernels: needs a CUDA device (or --smoke with TRITON_INTERPRET=1 to check the script)")
    peak = peak_gbps(device, args.peak_gbps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; peak memory bandwidth: {peak or 'unknown'} GB/s; {args.tensors} tensors; "
          f"world size {WORLD}; medians of {args.repeats} interleaved repeats\n")
    print("| size | operation | torch (ms) | fused (ms) | speed-up | fused GB/s | % of peak |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for size_mb in args.sizes_mb:
        size_cases = cases(size_mb * MB, args.tensors, device)
        iters = 1 if args.smoke else max(1, 256 // size_mb)
        for case in size_cases:  # warm-up: compilation, allocator
            case.torch_fn()
            case.fused_fn()
        times: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in size_cases}
        for _ in range(args.repeats):
            for case in size_cases:
                times[case.name][0].append(seconds_per_call(case.torch_fn, iters, device))
                times[case.name][1].append(seconds_per_call(case.fused_fn, iters, device))
        for case in size_cases:
            torch_s, fused_s = times[case.name]
            speedup = statistics.median(t / f for t, f in zip(torch_s, fused_s, strict=True))
            gbps = case.bytes_moved / statistics.median(fused_s) / 1e9
            share = f"{100 * gbps / peak:.0f}%" if peak else "n/a"
            print(f"| {size_mb} MB | {case.name} | {1e3 * statistics.median(torch_s):.3f} | "
                  f"{1e3 * statistics.median(fused_s):.3f} | {speedup:.2f}x | {gbps:.0f} | {share} |")
        del size_cases


if __name__ == "__main__":
    main()
