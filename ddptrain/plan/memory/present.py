"""The GPU this process runs on, as the memory planner sees it: its own memory, less what is already in use.

A name says little about memory: a MIG slice reports the whole card's name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb",
about 10 GiB of its 80), a GH200 contains "H200" (about 95 GiB, not the H200's 141), and another process may
already hold part of any GPU. So a present GPU is planned from ``get_device_properties(i).total_memory`` less what
``mem_get_info`` says is in use (read before the process groups existed where the run read it then:
``runtime/memory_before_groups.py``), and its bf16 support from its compute capability; its name only picks the kind
in ``DEVICES`` whose dense peak it has (a MIG slice: its share of the card's compute slices, ``g`` of 7). The
presets stay for planning a GPU that is not here (``plan.device=...``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ddptrain.plan.memory.planner import DEVICES, Device, GiB, kind_of, target_device
from ddptrain.runtime.memory_before_groups import in_use_before_groups

MIG_COMPUTE_SLICES = 7  # an A100's or H100's compute slices; a "<g>g.<memory>gb" MIG profile holds g of them


def present_device(index: int) -> Device:
    """CUDA device ``index`` as it is now: its name, total memory, what is in use, bf16, dense peak, NVLS."""
    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    in_use = total - free
    if (before := in_use_before_groups(index)) is not None:  # NCCL's init allocations since: its allowance's
        in_use = min(in_use, before)
    name = properties.name
    kind = kind_of(name)
    mig = re.search(r"\bMIG (\d+)g\.", name)
    peak = DEVICES[kind].peak_tflops if kind else 0.0
    if mig:
        peak *= int(mig.group(1)) / MIG_COMPUTE_SLICES
    bf16 = properties.major >= 8  # the rule a run resolves train.precision=auto by (device_precision)
    # NVLS needs NVSwitch (Hopper SXM and newer; a PCIe Hopper has none and is over-counted); a MIG slice talks to
    # no other GPU over NVLink
    nvls = properties.major >= 9 and mig is None
    # the reading holds this process's CUDA context (mem_get_info creates it): the planner's context allowance
    # leaves that part out (Allowances.for_run)
    return Device(name, properties.total_memory / GiB, bf16, peak, "cuda", in_use_gib=in_use / GiB, nvls=nvls,
                  context_in_use=True)


def this_device(device: torch.device) -> Device:
    """The run's device as the planner sees it: a GPU as it is now (``present_device``), else this CPU."""
    if device.type != "cuda":
        return target_device("cpu", None, None)
    return present_device(torch.cuda.current_device() if device.index is None else device.index)


def with_memory(device: Device, memory_gib: float | None) -> Device:
    """``device`` planned with ``memory_gib`` (``plan.device_memory_gib``) in place of its free memory."""
    return device if memory_gib is None else replace(device, memory_gib=memory_gib, in_use_gib=0.0,
                                                      context_in_use=False)


def device_for_plan(name: str | None, memory_gib: float | None, peak_override: float | None) -> Device:
    """The dry run's target: ``plan.device`` when set (a preset, or cpu); else this machine's current GPU as it is
    (``present_device``), else its CPU. ``plan.device_memory_gib`` and ``metrics.peak_tflops`` override."""
    if name is None and torch.cuda.is_available():
        device = with_memory(present_device(torch.cuda.current_device()), memory_gib)
        return replace(device, peak_tflops=peak_override or device.peak_tflops)
    return target_device(name, memory_gib, peak_override)
