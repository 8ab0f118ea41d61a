"""Logging per rank: rank 0 talks (console + train.log in the run dir); the others report only problems."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(rank: int, run_dir: Path | None = None) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    if rank == 0:
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        console.setLevel(logging.INFO)
    else:
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
        console.setLevel(logging.WARNING)
    root.addHandler(console)
    if rank == 0 and run_dir is not None:
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for noisy in ("httpx", "urllib3", "datasets", "transformers", "filelock", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
