"""Every device-to-host path a training step could take, seen on a CPU run through a ``TorchFunctionMode``.

On CUDA each of these makes the host wait for the device: a value read (``item``, ``tolist``, ``bool(t)``,
``float(t)``, printing a tensor), an op whose output shape depends on the data (``nonzero``, ``torch.equal``,
masked indexing ``t[mask]``), and a blocking copy to the host (``.cpu()``, ``.to("cpu")``, ``host.copy_(t)``).
On a CPU run every tensor already lives on the host, so the mode tells a copy to the host from a placement on
the run's device by what the code asked for: ``.to(device)`` with the run's own device object, or with a device
object read from a device tensor's ``.device`` (where that tensor lives), a device object torch's own utilities
pass (``clip_grad_norm_`` groups gradients by device in C++), or ``non_blocking=True`` (the loader's pinned
copies) is a placement; any other CPU target (``"cpu"``, ``torch.device("cpu")``) is a copy to the host.
A ``copy_`` reads back when its destination is a host tensor: pinned, made by ``.cpu()``/``.to("cpu")``, or made
by a factory without the run's device.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VALUE_READS = frozenset({"item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
                         "__complex__", "__format__", "__repr__", "__str__", "is_nonzero"})
DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal",
                            "allclose", "bincount"})
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put", "index"})
TORCH_DIR = str(Path(torch.__file__).parent)
DEVICE_OF = torch.Tensor.device.__get__  # reading ``t.device`` goes through the mode too
FACTORIES = frozenset({"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "randn", "rand"})


def _device_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | str | None:
    """The target device of ``Tensor.to(...)``: a device, a device string, another tensor's device, or None."""
    for value in (kwargs.get("device"), *args[1:2]):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (str, torch.device)):
            return value
    return None


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """Records ``(name, why)`` for every device-to-host call while active, into ``record``."""

    def __init__(self, run_device: torch.device, record: Callable[[str, str], None]) -> None:
        super().__init__()
        self.run_device = run_device
        self.record = record
        self.host_tensors: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: a tensor's == is elementwise
        self.placements: dict[int, torch.device] = {}  # devices read from device tensors, held so ids stay theirs

    def _to_host(self, target: torch.device | str | None, kwargs: dict[str, Any], caller: str = "") -> bool:
        if target is None or target is self.run_device or id(target) in self.placements \
                or kwargs.get("non_blocking", False):
            return False
        if isinstance(target, torch.device) and caller.startswith(TORCH_DIR):
            return False  # torch's own utilities place on devices they grouped the tensors by (in C++)
        return torch.device(target).type == "cpu"

    def _is_host(self, tensor: torch.Tensor) -> bool:
        known = self.host_tensors.get(id(tensor))
        return (known is not None and known() is tensor) or tensor.is_pinned()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        why = None
        if name in VALUE_READS:
            why = "value read"
        elif name in DATA_DEPENDENT or (name == "where" and len(args) + len(kwargs) == 1):
            why = "data-dependent shape"
        elif name in INDEXING and len(args) > 1 and _has_bool_index(args[1]):
            why = "masked indexing"
        elif name == "cpu" or (name == "to" and self._to_host(_device_arg(args, kwargs), kwargs,
                                                               sys._getframe(1).f_code.co_filename)):
            why = "copy to the host"
        elif name == "copy_" and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            dst = args[0]
            if self._is_host(dst):
                why = "copy to the host"
        if why is not None:
            self.record(name, why)
        out = func(*args, **kwargs)
        made_on_host = name in FACTORIES and (kwargs.get("pin_memory") or self._to_host(kwargs.get("device", "cpu"),
                                                                                        {}))
        if func == DEVICE_OF and not self._is_host(args[0]):
            self.placements[id(out)] = out
        if isinstance(out, torch.Tensor) and ((why == "copy to the host" and name != "copy_") or made_on_host):
            self.host_tensors[id(out)] = weakref.ref(out)
        return out
