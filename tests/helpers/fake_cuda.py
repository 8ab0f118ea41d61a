"""``torch.cuda`` answering as a machine with the given GPUs would, on this CPU-only machine: what the device code
reads about a device (its name, total and free memory, compute capability, SM count, MIG, how many there are).

``fake_cuda(monkeypatch, H100, ...)`` replaces the primitives torch's own helpers are built on —
``is_available``, ``device_count``, ``current_device``/``set_device``, ``get_device_properties``, ``mem_get_info``
and the bf16 tensor probe — so ``get_device_name``, ``get_device_capability`` and ``is_bf16_supported`` run
torch's own code on top of them. Memory in use by others is ``FakeGPU.used``; a test changes it with
``FakeCuda.use``; this process's own CUDA context (``context_gib``) joins it on a device once ``set_device`` or
``mem_get_info`` has touched it, as a real context does. The figures below are about what torch reports on each
card (``total_memory`` is a little under the marketed size; a MIG slice reports its own memory and the whole
card's name).

Not modelled: allocating anything (a tensor on ``cuda`` still fails: no kernels run), streams, events and
synchronization, the caching allocator's statistics (``memory_allocated``, ``max_memory_allocated``), memory that
changes by itself, NCCL, MIG's compute share and its lack of peer-to-peer, and lazy initialization (every call
answers at once; nothing is initialized but the context's memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch

GiB = 1024**3


@dataclass(frozen=True)
class FakeGPU:
    name: str
    total_memory: int  # bytes, as get_device_properties reports
    capability: tuple[int, int]
    multi_processor_count: int
    used: int = 0  # bytes already in use when asked (mem_get_info's total less its free)

    @property
    def is_mig(self) -> bool:
        return re.search(r"\bMIG \d+g\.", self.name) is not None

    def using(self, gib: float) -> FakeGPU:
        return replace(self, used=round(gib * GiB))


def _gib(gib: float) -> int:
    return round(gib * GiB)


H100 = FakeGPU("NVIDIA H100 80GB HBM3", _gib(79.22), (9, 0), 132)
H100_MIG_1G = FakeGPU("NVIDIA H100 80GB HBM3 MIG 1g.10gb", _gib(9.75), (9, 0), 16)  # one of seven slices
GH200 = FakeGPU("NVIDIA GH200 480GB", _gib(95.0), (9, 0), 132)  # the Hopper half of a Grace Hopper, 96 GB HBM3
A100 = FakeGPU("NVIDIA A100-SXM4-80GB", _gib(79.15), (8, 0), 108)
L4 = FakeGPU("NVIDIA L4", _gib(22.05), (8, 9), 58)
RTX_4090 = FakeGPU("NVIDIA GeForce RTX 4090", _gib(23.65), (8, 9), 128)
T4 = FakeGPU("Tesla T4", _gib(14.58), (7, 5), 40)
V100 = FakeGPU("Tesla V100-SXM2-32GB", _gib(31.74), (7, 0), 80)


@dataclass
class FakeCuda:
    gpus: list[FakeGPU]
    current: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    context: int = 0  # bytes of this process's CUDA context on a device, in use once anything has touched it
    touched: set[int] = field(default_factory=set)  # devices whose context this process has created

    def index(self, device: object = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            return self.current if device.index is None else device.index
        index = int(device)  # type: ignore[call-overload]
        if not 0 <= index < len(self.gpus):
            raise AssertionError("Invalid device id")  # what torch raises for an index out of range
        return index

    def gpu(self, device: object = None) -> FakeGPU:
        return self.gpus[self.index(device)]

    def use(self, device: int, gib: float) -> None:
        """Have ``gib`` GiB in use on ``device`` from now on."""
        self.gpus[device] = self.gpus[device].using(gib)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def properties(self, device: object = None) -> SimpleNamespace:
        self._count("get_device_properties")
        gpu = self.gpu(device)
        return SimpleNamespace(name=gpu.name, total_memory=gpu.total_memory, major=gpu.capability[0],
                               minor=gpu.capability[1], multi_processor_count=gpu.multi_processor_count,
                               is_integrated=False, is_multi_gpu_board=False, warp_size=32)

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        self._count("mem_get_info")
        index = self.index(device)
        self.touched.add(index)  # cudaMemGetInfo needs a context: it creates this process's
        gpu = self.gpus[index]
        used = gpu.used + self.context
        return gpu.total_memory - used, gpu.total_memory

    def set_device(self, device: object) -> None:
        self.current = self.index(device)
        self.touched.add(self.current)  # CUDA 12's cudaSetDevice creates the device's primary context


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *gpus: FakeGPU, context_gib: float = 0.0) -> FakeCuda:
    """Make ``torch.cuda`` answer as a machine with ``gpus`` (device 0 current); undone with ``monkeypatch``.
    ``context_gib``: this process's CUDA context, in use on a device from the first call that needs one."""
    fake = FakeCuda(list(gpus), context=round(context_gib * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(fake.gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(fake.gpus))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake.properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    # every CUDA GPU holds bf16 tensors (before sm80 only emulated): torch's probe would allocate one
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda *_: True)
    return fake
