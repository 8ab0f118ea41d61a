"""``data.micro_batch_size=auto`` as a rank resolves it on named GPUs: the micro batch it chooses and its planned
need per rank, with ``torch.cuda`` faked to report each GPU's name, total memory and memory already in use
(``tests/helpers/fake_cuda.py``; nothing runs on a GPU, the plan is traced on fake tensors as a run traces it).

It calls the run's own start-up function (``app.launch.agreed_micro_batch``) at one rank, so it runs unchanged on
an older checkout too: put that checkout first on PYTHONPATH (with this script's ``tests/helpers/fake_cuda.py``
copied into it if it lacks one) to print the before figures.

    PYTHONPATH=. python scripts/auto_batch_devices.py                        # the default run below
    PYTHONPATH=. python scripts/auto_batch_devices.py --used-gib 0 model=gpt2_small data.seq_len=1024
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time

import pytest
import torch

from ddptrain.app.launch import agreed_micro_batch
from ddptrain.config.compose import compose_config, typed_config
from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import DistEnv
from tests.helpers.fake_cuda import GH200, H100, H100_MIG_1G, RTX_4090, FakeGPU, fake_cuda

GPUS = (H100_MIG_1G, RTX_4090, H100, GH200)
# LoRA on a bf16 Llama 1.1B (TinyLlama's shape), seq 2048, selective checkpointing: a micro batch of a few GiB
RUN = ["model=llama_1b", "model.lora.enabled=true", "model.dtype=bf16", "model.activation_checkpointing=selective",
       "data.seq_len=2048", "data.global_batch_size=64", "data.micro_batch_size=auto", "train.precision=bf16"]
GiB = 1024**3


def resolve(gpu: FakeGPU, overrides: list[str]) -> tuple[str, str]:
    """The micro batch chosen on ``gpu`` at one rank and the line the run logs (or its one-line error)."""
    run = typed_config(compose_config(overrides))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
    with pytest.MonkeyPatch.context() as patch:
        fake_cuda(patch, gpu)
        try:
            typed, _ = agreed_micro_batch(run, env, torch.device("cuda", 0))
        except ConfigError as exc:
            return "none fits", str(exc)
    return str(typed.data.micro_batch_size), LINES[-1] if LINES else ""


LINES: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LINES.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--used-gib", type=float, default=2.0, help="memory already in use on each GPU")
    parser.add_argument("overrides", nargs="*", default=RUN, help=f"config overrides (default: {' '.join(RUN)})")
    args = parser.parse_args()
    logging.getLogger("ddptrain").addHandler(_Lines())
    logging.getLogger("ddptrain").setLevel(logging.INFO)
    print(f"load average {os.getloadavg()} | {' '.join(args.overrides)} | {args.used_gib:g} GiB in use")
    print("| GPU (total_memory, in use) | micro batch | largest that fits | need per rank | usable (as planned) "
          "| seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for gpu in GPUS:
        start = time.perf_counter()
        micro, line = resolve(gpu.using(args.used_gib), args.overrides)
        found = re.search(r"\(([\d.]+) of ([\d.]+) GiB usable", line)
        need, usable = (f"{found[1]} GiB", f"{found[2]} GiB") if found else ("-", "-")
        if not found and (one := re.search(r"micro batch 1 needs ([\d.]+) GiB per rank, over the ([\d.]+)", line)):
            need, usable = f"{one[1]} GiB at micro batch 1", f"{one[2]} GiB"
        largest = re.search(r"; (\d+) fits but does not divide", line)
        print(f"| {gpu.name} ({gpu.total_memory / GiB:.2f} GiB, {args.used_gib:g} in use) | {micro} "
              f"| {largest[1] if largest else micro} | {need} | {usable} | {time.perf_counter() - start:.0f} |",
              flush=True)
        print(f"  {line}", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
