"""``compile_blocks`` on a backend of the test's choosing: it calls ``nn.Module.compile`` with Inductor's defaults;
a test on CPU compiles with ``eager`` or ``aot_eager`` instead (the same graphs and breaks, no C++ build)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def module_compile_backend(backend: Any) -> Iterator[None]:
    """``torch.nn.Module.compile`` with ``backend`` whatever its caller asks, put back afterwards."""
    original = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: original(self, backend=backend)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.compile = original  # type: ignore[method-assign]
