"""How long a checkpoint save stops training: synchronous against ``checkpoint.async_save=true``.

Saves the same trained state (weights + AdamW moments) through the real ``Checkpointer``, alternating the two
modes over repeats (sync, async, sync, async, ...) so machine noise hits both alike, and reports medians of the
time training is blocked per save and, for async saves, how long the background write took. It also times the
sizes-and-checksums pass of a commit (CRC-32 of every file): part of a synchronous save's blocked time, and
done on the background writer's thread for an async save:

    torchrun --standalone --nproc-per-node=2 scripts/bench_checkpoint.py --repeats 5 --hidden 768 --layers 6

Runs on CUDA too (one GPU per rank; the async copy is then device -> host).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddptrain.checkpoint import MARKER, Checkpointer, TrainState
from ddptrain.checkpoint.format import manifest
from ddptrain.config.compose import build_config
from ddptrain.models import build_model, model_vocab_size
from ddptrain.optim import build_optimizer
from ddptrain.parallel import wrap_model
from ddptrain.runtime.process_group import DistEnv, pick_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    env = DistEnv.from_environ()
    device = pick_device(env)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    out = args.dir or (Path(tempfile.mkdtemp(prefix="bench-ckpt-")) if env.is_main else None)
    root = Path(_broadcast(str(out)))
    model_cfg = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.hidden // 64,
                 "num_kv_heads": args.hidden // 64}
    modes = {"sync": False, "async": True}
    cfgs = {m: build_config({"model": model_cfg, "checkpoint": {"async_save": a, "keep_last": 1}})
            for m, a in modes.items()}
    model = build_model(cfgs["sync"].model, model_vocab_size(cfgs["sync"].model, 8192), eos_id=0).to(device)
    wrapped = wrap_model(model, cfgs["sync"].parallel, device)
    optimizer = build_optimizer(model, cfgs["sync"].optim)
    ids = torch.randint(0, 8192, (2, 64), device=device)
    wrapped.outer(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # AdamW's moments exist: a save holds 3x the weights
    checkpointers = {m: Checkpointer(cfgs[m], root / m, wrapped.strategy) for m in modes}
    blocked: dict[str, list[float]] = {m: [] for m in modes}
    written: list[float] = []
    checksums: list[float] = []  # rank 0: the commit's pass over the files it just wrote
    for repeat in range(args.repeats):
        for mode, checkpointer in checkpointers.items():
            state = TrainState(repeat + 1, {}, 0, 0, env.world_size, 8, 0)
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(state, model, optimizer, wait=False)
            blocked[mode].append(time.perf_counter() - start)
            checkpointer.wait()  # the background write (async) is done and committed
            if mode == "async":
                written.append(time.perf_counter() - start)
            elif env.is_main:
                start = time.perf_counter()
                manifest(checkpointer.committed()[-1], skip=frozenset({MARKER}))
                checksums.append(time.perf_counter() - start)
            dist.barrier()
    n_params = sum(p.numel() for p in model.parameters())
    if env.is_main:
        sync, async_ = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
        print(f"{n_params / 1e6:.1f}M parameters, {3 * 4 * n_params / 2**30:.2f} GiB of weights + AdamW state, "
              f"{env.world_size} ranks on {device.type}, medians of {args.repeats} interleaved repeats")
        print("| mode | training blocked per save (s) | save committed after (s) |")
        print("|---|---:|---:|")
        print(f"| synchronous | {sync:.3f} | - |")
        print(f"| async_save=true | {async_:.3f} ({async_ / sync:.2f}x) | {statistics.median(written):.3f} |")
        check = statistics.median(checksums)
        print(f"commit's sizes-and-checksums pass: {check:.3f} s ({check / sync:.0%} of a synchronous save's blocked "
              "time; on the writer thread for async saves)")
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _broadcast(value: str | None) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


if __name__ == "__main__":
    main()
