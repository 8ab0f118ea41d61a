"""Fine-tuning benchmarks through the real training loop, inside one torchrun job, variants interleaved over repeats
(A B C A B C ...), medians reported:

- ``adapters``: full fine-tuning vs LoRA vs LoRA + gradient checkpointing: step time, bytes per step, activation
  memory.
- ``packing``: padded vs packed micro batches (``data.packing``) on a skewed-length set (most examples short, a
  few near ``seq_len``): real tokens/s, ``padding_pct``, and the largest per-step loss difference.

    torchrun --standalone --nproc-per-node=2 scripts/bench_finetune.py --repeats 3 --steps 10
    torchrun --standalone --nproc-per-node=2 scripts/bench_finetune.py --suite packing --repeats 3 --steps 10

Activation memory is what autograd keeps for backward during one micro batch's forward: the distinct storages
of the tensors it saves, weights excluded (measured with saved-tensor hooks; checkpointed blocks save only
their inputs). On CUDA the peak allocated memory of one forward/backward is reported too.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.data import build_token_data
from ddptrain.data.instruct import PadCollate, generated_instructions
from ddptrain.data.tokenizer import train_bpe
from ddptrain.models import build_model
from ddptrain.models.lora import prepare_for_finetuning
from ddptrain.runtime.process_group import DistEnv
from ddptrain.train.trainer import train

LORA = {"enabled": True, "r": 16, "alpha": 32.0}
VARIANTS: dict[str, dict[str, Any]] = {  # variant -> model overrides
    "full fine-tuning": {},
    "LoRA r=16": {"lora": LORA},
    "LoRA r=16 + checkpointing": {"lora": LORA, "activation_checkpointing": "full"},
}


def make_base(out: Path) -> None:
    """A small Llama (hidden 256, 4 layers) and a byte-level BPE, saved as a "pretrained" model directory."""
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(2000)], 2048)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)


PACKING_SEQ_LEN = 256
PACKING_VARIANTS = {"padded": False, "packed": True}  # variant -> data.packing


def make_skewed(path: Path, n: int = 1200, long_share: float = 0.1, seed: int = 0) -> None:
    """Prompt/completion records as JSONL: most are one short instruction (tens of tokens), ``long_share`` of them
    carry a completion of a few hundred words, cut at ``seq_len`` when tokenized (the skew of instruction data)."""
    rng = random.Random(seed)
    short = generated_instructions(n, seed)
    words = [w for p, c in short for w in f"{p} {c}".split()]
    with path.open("w") as f:
        for prompt, completion in short:
            if rng.random() < long_share:
                completion = " ".join(rng.choice(words) for _ in range(rng.randrange(250, 400)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def packing_config(base: Path, steps: int, out: Path, packing: bool) -> Config:
    return build_config({
        "model": {"pretrained": str(base), "lora": LORA},
        "data": {"source": "files", "paths": [str(out / "skewed.jsonl")], "format": "prompt_completion",
                 "tokenizer": str(base), "seq_len": PACKING_SEQ_LEN, "packing": packing, "global_batch_size": 32,
                 "micro_batch_size": 16, "cache_dir": str(out)},
        "train": {"steps": steps, "log_every": 1, "eval_every": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "logger": {"progress": False, "jsonl": True},
        "checkpoint": {"export": False},
    })


def config(base: Path, steps: int, out: Path, model: dict[str, Any]) -> Config:
    return build_config({
        "model": {"pretrained": str(base), **model},
        "data": {"source": "instructions", "format": "prompt_completion", "tokenizer": str(base), "seq_len": 64,
                 "num_samples": 4000, "global_batch_size": 32, "micro_batch_size": 16, "cache_dir": str(out)},
        "train": {"steps": steps, "log_every": 2, "eval_every": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "logger": {"progress": False, "jsonl": False},
        "checkpoint": {"export": False},
    })


def activation_bytes(cfg: Config) -> tuple[int, float | None]:
    """Bytes autograd saves for backward in one micro batch's forward; CUDA: peak allocated of forward+backward."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    data = build_token_data(cfg.data)
    model = prepare_for_finetuning(build_model(cfg.model, data.vocab_size, device=device).to(device), cfg.model)
    model.train()
    rows = [data.train[i] for i in range(cfg.data.micro_batch_size)]
    batch = {k: v.to(device) for k, v in PadCollate(data.tokenizer.eos_token_id)(rows).items()}
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:  # views of one storage count once
            seen.add(storage.data_ptr())
            saved += storage.nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return saved, peak


def run_adapters(env: DistEnv, base: Path, out: Path, args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    comm: dict[str, float] = {}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(args.repeats):
        for name, model in VARIANTS.items():
            summary = train_in(out / name.replace(" ", "_").replace("+", ""), config(base, args.steps, out, model), env)
            times[name].append(summary["step_time_s"])
            comm[name] = summary.get("comm_bytes", 0.0)
            counts[name] = (summary["trainable_parameters"], summary["parameters"])
    if not env.is_main:
        return
    reference = statistics.median(times["full fine-tuning"])
    print(f"{env.world_size} ranks, {args.steps} steps, {args.repeats} interleaved repeats (medians)")
    print("| variant | trainable / total | step time | vs full | bytes all-reduced per step | activations saved "
          "per micro batch |")
    print("|---|---|---|---|---|---|")
    for name, model in VARIANTS.items():
        step = statistics.median(times[name])
        saved, peak = activation_bytes(config(base, args.steps, out, model))
        cuda = f" (CUDA peak {peak:.1f} MiB)" if peak is not None else ""
        trainable, total = counts[name]
        print(f"| {name} | {trainable:,} / {total:,} | {step * 1e3:.1f} ms | {step / reference:.2f}x | "
              f"{comm[name] / 1e6:.3f} MB | {saved / 2**20:.1f} MiB{cuda} |")


def run_packing(env: DistEnv, base: Path, out: Path, args: argparse.Namespace) -> None:
    if env.is_main and not (out / "skewed.jsonl").is_file():
        make_skewed(out / "skewed.jsonl")
    dist.barrier()
    tps: dict[str, list[float]] = {name: [] for name in PACKING_VARIANTS}
    step_s: dict[str, list[float]] = {name: [] for name in PACKING_VARIANTS}
    padding: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, packing in PACKING_VARIANTS.items():
            run_dir = out / f"skewed_{name}"
            summary = train_in(run_dir, packing_config(base, args.steps, out, packing), env)
            tps[name].append(summary["tokens_per_s"])
            step_s[name].append(summary["step_time_s"])
            padding[name] = summary["padding_pct"]
            if env.is_main:
                lines = (run_dir / "metrics.jsonl").read_text().splitlines()
                losses[name] = [json.loads(line)["loss"] for line in lines]
    if not env.is_main:
        return
    reference = statistics.median(tps["padded"])
    loss_diff = max(abs(a - b) for a, b in zip(losses["padded"], losses["packed"], strict=True))
    print(f"{env.world_size} ranks, skewed set (90% short, 10% near {PACKING_SEQ_LEN} tokens), LoRA r=16, global batch "
          f"32 x micro batch 16, {args.steps} steps, {args.repeats} interleaved repeats (medians)")
    print("| micro batches | real tokens/s | vs padded | step time | padding_pct |")
    print("|---|---|---|---|---|")
    for name in PACKING_VARIANTS:
        t = statistics.median(tps[name])
        print(f"| {name} | {t:,.0f} | {t / reference:.2f}x | {statistics.median(step_s[name]) * 1e3:.0f} ms | "
              f"{padding[name]:.1f}% |")
    print(f"largest per-step loss difference, packed vs padded: {loss_diff:.2e}")


def train_in(run_dir: Path, cfg: Config, env: DistEnv) -> dict[str, Any]:
    """One run of the real training loop in a fresh ``run_dir``; its summary."""
    if env.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.barrier()
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(cfg, env, torch.device("cpu"), run_dir, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--suite", choices=["adapters", "packing", "all"], default="all")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    env = DistEnv.from_environ()
    logging.basicConfig(level=logging.WARNING)
    out = Path(tempfile.gettempdir()) / "ddptrain-bench-finetune"
    base = out / "base"
    if env.is_main and not (base / "config.json").is_file():
        make_base(base)
    dist.barrier()
    if args.suite in ("adapters", "all"):
        run_adapters(env, base, out, args)
    if args.suite in ("packing", "all"):
        run_packing(env, base, out, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
