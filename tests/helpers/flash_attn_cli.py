"""``ddptrain`` with the flash-attn twin installed: ``torchrun ... tests/helpers/flash_attn_cli.py <overrides>``.

A CLI run on CPU that takes transformers' FlashAttention-2 path as a run on an H100 with ``flash-attn`` installed
takes it: each worker installs the twin (``flash_attn_twin.install``: the package, transformers' availability
checks, and the CPU among ddptrain's flash devices) before ``ddptrain`` runs; nothing else about the run changes.
With ``DDPTRAIN_TWIN_REPORT`` set to a directory, each rank writes there what the twin was asked
(``rank<N>.json``: dense and varlen calls, the most segments in one call, whether every maximum length came as an
int, none read back).

Run as a script with ``PYTHONSAFEPATH=1``, so that neither its folder nor the checkout is on the workers' path:
``ddptrain`` is imported as installed, and the twin is loaded from its file beside this one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType


def _load_twin() -> ModuleType:
    """``flash_attn_twin.py`` beside this file, as the module ``flash_attn_twin`` (no package on the path)."""
    spec = importlib.util.spec_from_file_location("flash_attn_twin", Path(__file__).with_name("flash_attn_twin.py"))
    assert spec is not None and spec.loader is not None
    twin = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = twin  # before it runs: its dataclasses look their module up there
    spec.loader.exec_module(twin)
    return twin


def main() -> int:
    twin = _load_twin()
    calls = twin.install(twin.Permanent())
    from ddptrain.app.cli import run_cli

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    code = run_cli(sys.argv[1:])
    if report := os.environ.get("DDPTRAIN_TWIN_REPORT"):
        record = {"dense": calls.dense, "varlen": calls.varlen,
                  "most_segments": max((cu.numel() - 1 for cu, _ in calls.segments), default=0),
                  "int_lengths": calls.read_back == 0}
        (Path(report) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    sys.exit(main())
