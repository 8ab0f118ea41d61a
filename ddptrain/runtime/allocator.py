"""The CUDA caching allocator's settings: ddptrain turns on expandable segments unless the user set the allocator.

Prompt/completion micro batches change shape from one micro batch to the next (padded to their longest example,
or packed into a varying number of rows). The caching allocator keeps freed blocks in segments of the sizes first
asked for, so a later, slightly larger request cannot reuse them and takes a new segment: reserved memory grows
past the peak that is in use, which is fragmentation. With ``expandable_segments:True`` a segment grows in place
(virtual memory mapped page by page), so freed memory is reused whatever the shapes (NVIDIA NeMo turned it on for
its dynamic-shape ASR batches after profiles showed a reallocation in every mini batch: NVIDIA/NeMo#9061).

torch 2.13 reads two variables, once, when the allocator first starts (``c10/core/AllocatorConfig.cpp``,
``c10/cuda/CUDAAllocatorConfig.h``). The device-generic keys, ``expandable_segments`` among them, come from
``PYTORCH_ALLOC_CONF`` when it is set, else from ``PYTORCH_CUDA_ALLOC_CONF`` (kept "with lower priority": only
the first variable set is parsed for them, so with both set the CUDA one's generic keys are ignored); CUDA-only
keys (``backend``, ...) come from ``PYTORCH_CUDA_ALLOC_CONF`` first. Within one variable the last occurrence of a
key wins. ``use_expandable_segments`` must run before anything touches a CUDA device, which is why the command
line calls it first (``app/cli.py``; torchrun's workers inherit the launcher's environment and call it again).
This module imports nothing heavy, so that nothing has started the allocator yet. The memory planner reads
``expandable_segments`` to count fragmentation (``plan/memory/overheads.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

# the order torch 2.13 reads the device-generic keys in (AcceleratorAllocatorConfig::instance: the first set wins)
CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def allocator_conf(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, value) that torch reads ``expandable_segments`` and the other device-generic keys from, or None
    when neither variable is set."""
    return next(((var, environ[var]) for var in CONF_VARS if var in environ), None)


def use_expandable_segments(environ: MutableMapping[str, str]) -> bool:
    """Set ``PYTORCH_ALLOC_CONF=expandable_segments:True`` when the user set neither variable (a user's own
    settings stand as they are). True when this call set it."""
    if allocator_conf(environ) is not None:
        return False
    environ["PYTORCH_ALLOC_CONF"] = EXPANDABLE
    return True


def expandable_segments(environ: Mapping[str, str]) -> bool:
    """Whether the allocator settings torch reads turn expandable segments on (the last ``expandable_segments``
    option of that variable wins, as in torch's parser); with none set, what ``use_expandable_segments`` will set."""
    conf = allocator_conf(environ)
    if conf is None:
        return True
    on = False
    for option in conf[1].split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


def startup_line(environ: Mapping[str, str]) -> str | None:
    """What a CUDA run logs about its allocator at start-up: the variable torch reads expandable segments from,
    its value and whether they are on; a ``PYTORCH_CUDA_ALLOC_CONF`` set beside it is named as read for CUDA-only
    keys. None when neither is set."""
    if (conf := allocator_conf(environ)) is None:
        return None
    var, value = conf
    line = (f"CUDA caching allocator: {var}={value} (expandable segments "
            f"{'on' if expandable_segments(environ) else 'off'})")
    other = CONF_VARS[1]
    if var != other and other in environ:
        line += f"; {other}={environ[other]} is read for CUDA-only keys only (its expandable_segments is ignored)"
    return line
