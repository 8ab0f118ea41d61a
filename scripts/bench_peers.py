"""ddptrain's loop against what a user would otherwise write: a minimal hand-written torch DDP loop (the floor)
and the same training through Hugging Face ``accelerate`` (``pip install -e .[bench]``).

Same model (built by ddptrain's ``build_model``), same data set (read by a plain torch DataLoader in the
peers), same batch, same world size, same AdamW kernel and clipping. The three run interleaved (A B C A B C ...)
inside one torchrun job and report median step times:

    torchrun --standalone --nproc-per-node=2 scripts/bench_peers.py --repeats 3 --steps 25

Each run times windows of ``--window`` steps (a loss all-reduce closes each, as logging does) and takes the
median of its windows after the first (warm-up), which is how ddptrain's own summary reports ``step_time_s``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.data import build_token_data
from ddptrain.models import build_model
from ddptrain.optim import impl_kwargs
from ddptrain.runtime.process_group import DistEnv, main_first
from ddptrain.train.trainer import train


def config(args: argparse.Namespace, out: Path) -> Config:
    return build_config({
        "model": {"vocab_size": args.vocab},
        "data": {"source": "synthetic", "vocab_size": args.vocab, "num_samples": 4096, "seq_len": args.seq_len,
                 "global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch,
                 "cache_dir": str(out / "cache")},
        "train": {"steps": args.steps, "log_every": args.window, "eval_every": 0},
        "logger": {"progress": False, "jsonl": False},
        "checkpoint": {"export": False},
    })


def ddptrain_loop(cfg: Config, env: DistEnv, out: Path) -> float:
    run_dir = out / "ddptrain"
    if env.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.barrier()
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(cfg, env, torch.device("cpu"), run_dir, {})["step_time_s"]


def loader(cfg: Config, env: DistEnv, train_set: Dataset) -> DataLoader:
    """The DataLoader a user writes: this rank's shuffled share, micro batches of ``data.micro_batch_size``."""
    sampler = DistributedSampler(train_set, env.world_size, env.rank, shuffle=True, seed=cfg.train.seed)
    return DataLoader(train_set, batch_size=cfg.data.micro_batch_size, sampler=sampler, drop_last=True)


def endless(data: DataLoader) -> Iterator[torch.Tensor]:
    epoch = 0
    while True:
        data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for batch in data:
            yield batch["input_ids"]
        epoch += 1


def windows(cfg: Config, step: Callable[[int], torch.Tensor]) -> float:
    """Median step time over windows of ``log_every`` steps after the first; each window ends with a loss mean."""
    times, start = [], time.perf_counter()
    for i in range(cfg.train.steps):
        loss = step(i)
        if (i + 1) % cfg.train.log_every == 0:
            dist.all_reduce(loss)
            float(loss)  # the host reads the logged loss, as every loop does
            times.append((time.perf_counter() - start) / cfg.train.log_every)
            start = time.perf_counter()
    return statistics.median(times[1:] or times)


def _model_and_optimizer(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data.vocab_size)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay, **impl_kwargs(o.impl, torch.device("cpu")))
    return model, optimizer


def hand_loop(cfg: Config, env: DistEnv, train_set: Dataset) -> float:
    """The floor: DDP, forward/backward with no_sync on accumulation steps, clip, step. Nothing else."""
    model, optimizer = _model_and_optimizer(cfg)
    ddp = DistributedDataParallel(model)
    data = endless(loader(cfg, env, train_set))
    micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * env.world_size)

    def step(i: int) -> torch.Tensor:
        total = torch.zeros(())
        for m in range(micro):
            ids = next(data)
            with nullcontext() if m == micro - 1 else ddp.no_sync():
                loss = ddp(input_ids=ids, labels=ids).loss / micro
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return windows(cfg, step)


def accelerate_loop(cfg: Config, env: DistEnv, train_set: Dataset) -> float:
    """The same training as a user writes it with ``accelerate``: prepare, accumulate, backward, clip, step."""
    from accelerate import Accelerator

    micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * env.world_size)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro)
    model, optimizer = accelerator.prepare(*_model_and_optimizer(cfg))
    data = endless(loader(cfg, env, train_set))  # already this rank's share: not passed through prepare

    def step(i: int) -> torch.Tensor:
        total = torch.zeros(())
        for _ in range(micro):
            ids = next(data)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            total += loss.detach() / micro
        return total

    return windows(cfg, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    env = DistEnv.from_environ()
    logging.basicConfig(level=logging.WARNING)
    out = Path(tempfile.gettempdir()) / "ddptrain-bench-peers"
    cfg = config(args, out)
    train_set = main_first(env, lambda: build_token_data(cfg.data)).train
    runs: dict[str, Callable[[], float]] = {
        "hand-written DDP": lambda: hand_loop(cfg, env, train_set),
        "ddptrain": lambda: ddptrain_loop(cfg, env, out),
        "accelerate": lambda: accelerate_loop(cfg, env, train_set),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            dist.barrier()
            times[name].append(run())
    if env.is_main:
        print(report(times, args))
    dist.barrier()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], args: argparse.Namespace) -> str:
    medians = {name: statistics.median(t) for name, t in times.items()}
    lines = [
        f"world size {dist.get_world_size()}, {args.repeats} interleaved repeats x {args.steps} steps "
        f"(windows of {args.window}), micro batch {args.micro_batch} x {args.seq_len} tokens, "
        f"global batch {args.global_batch}; medians",
        "",
        "| loop | step time (ms) | ddptrain / loop | all repeats (ms) |",
        "|---|---:|---:|---|",
    ]
    for name, t in medians.items():
        runs = ", ".join(f"{x * 1e3:.0f}" for x in times[name])
        lines.append(f"| {name} | {t * 1e3:.1f} | {medians['ddptrain'] / t:.3f} | {runs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
