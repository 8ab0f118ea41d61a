"""Logging per rank: rank 0 talks (console + train.log in the run dir); the others report only problems."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(rank: int, run_dir: Path | None = None, console_info: bool = True) -> None:
    """Rank 0: info to the console (unless not ``console_info``: a replica group other than the first, whose
    lines would repeat group 0's) and to ``<run dir>/train.log``; the other ranks: warnings to the console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    if rank == 0:
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        console.setLevel(logging.INFO if console_info else logging.WARNING)
    else:
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
        console.setLevel(logging.WARNING)
    root.addHandler(console)
    if rank == 0 and run_dir is not None:
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # torchft (replica groups): its Manager logs every quorum and commit at info, three loggers with empty messages
    for noisy in ("httpx", "urllib3", "datasets", "transformers", "filelock", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for noisy in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):  # (warns of NCCL's recorder
        logging.getLogger(noisy).setLevel(logging.ERROR)  # on every quorum, even on CPU)
    import transformers

    transformers.logging.set_verbosity_error()


# torch's elastic launcher: its agent and worker processes, its launcher API and torch.distributed.run
ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def elastic_records_to_run_log(run_dir: Path) -> None:
    """In the process that launches the workers: torch elastic's records (its own error line for a worker that
    failed, ``E... torch/distributed/elastic/multiprocessing/api.py:...] failed (exitcode: 2) local_rank: 0 ...``,
    and its restarts) go to the run dir's ``train.log``, not to the console, where ddptrain's own line already
    says what failed. Torch prints them through its own handler, so they must not propagate to it."""
    handler: logging.Handler
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / "train.log", delay=True)  # appends beside rank 0's lines
        handler.setFormatter(logging.Formatter(_FORMAT))
    except OSError:  # an unwritable run dir: the workers' own line names it
        handler = logging.NullHandler()
    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
