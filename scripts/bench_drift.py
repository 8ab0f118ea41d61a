"""What the replica drift check (``train.drift_policy``) costs: planned bytes for a model preset, the fingerprint's
own time and ops on CPU, and the real command's step time with the check off and on.

    python scripts/bench_drift.py planned --model llama_1b       # bytes read and sent per check (arithmetic)
    python scripts/bench_drift.py fingerprint --model llama_tiny # one check's fingerprint on this CPU, ops counted
    python scripts/bench_drift.py runs --repeats 3 --steps 30    # ddptrain on 2 ranks, off/on alternating

``runs`` checks at every step (``train.check_every=1``), the worst case, so the agreement's all-reduce runs in both
settings and the difference is the fingerprint's; it reports the median of each setting's steady step time
(``step_time_s`` in summary.json) over interleaved runs (off, on, off, on, ...) and their ratio. Arguments after
``--`` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # torch documents dispatch modes at this path

from ddptrain.config.compose import compose_config, typed_config
from ddptrain.models.build import hf_config, model_vocab_size
from ddptrain.parallel.fingerprint import Combined
from ddptrain.train.drift import WORDS

H100_HBM_BYTES_S = 3.35e12  # H100 SXM's HBM3 bandwidth, as NVIDIA states it: planned time, not a measurement
RUN = ["data=synthetic", "launch.nproc_per_node=2", "train.log_every=10", "train.eval_every=0", "train.check_every=1",
       "checkpoint.export=false", "logger.progress=false"]


def _model(preset: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = typed_config(compose_config([f"model={preset}", "data=synthetic"])).typed
    vocab = model_vocab_size(cfg.model, cfg.data.vocab_size)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(cfg.model, vocab, None))


def planned(preset: str, check_every: int, ranks_per_node: int) -> None:
    """Per check: every parameter's bytes read twice (row and column sums of its words), the [rows] and [WIDTH]
    partial sums written and read once more (negligible), and 2 words and their complements in the agreement."""
    params = list(_model(preset, "meta").parameters())
    n = sum(p.numel() for p in params)
    read = 2 * sum(p.numel() * p.element_size() for p in params)
    sent, sent_hsdp = 2 * WORDS * 8, 2 * WORDS * 8 * ranks_per_node
    print(f"{preset}: {n / 1e9:.3f} B parameters in {len(params)} tensors (fp32)")
    print("| per | fingerprint reads | agreement grows by (DDP, ZeRO-1) | (HSDP, "
          f"{ranks_per_node} ranks per node) | H100 time at {H100_HBM_BYTES_S / 1e12:.2f} TB/s (planned) |")
    print("|---|---:|---:|---:|---:|")
    for label, every in (("check", 1), (f"step (train.check_every={check_every})", check_every)):
        print(f"| {label} | {read / every / 1e9:.2f} GB | {sent / every:g} B | {sent_hsdp / every:g} B | "
              f"{read / every / H100_HBM_BYTES_S * 1e3:.2f} ms |")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def measure_fingerprint(preset: str, repeats: int) -> None:
    """One check's fingerprint of every parameter against one read of them all (a sum per tensor), interleaved."""
    params = [p.detach() for p in _model(preset, "cpu").parameters()]
    size = sum(p.numel() * p.element_size() for p in params)

    combined = Combined(params, torch.device("cpu"))

    def check() -> torch.Tensor:
        return combined(params)

    def read_once() -> torch.Tensor:
        return torch.stack([p.sum() for p in params])

    times: dict[str, list[float]] = {"fingerprint": [], "one sum per tensor": []}
    for _ in range(repeats):
        for name, fn in (("fingerprint", check), ("one sum per tensor", read_once)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    with _Ops() as counted:
        check()
    fp, once = (statistics.median(times[k]) for k in times)
    print(f"{preset}: {len(params)} tensors, {size / 1e6:.1f} MB; median of {repeats} interleaved repeats, "
          f"{torch.get_num_threads()} threads")
    print("| what | time (ms) | GB/s of parameters | ratio |\n|---|---:|---:|---:|")
    print(f"| fingerprint (one check) | {fp * 1e3:.2f} | {size / fp / 1e9:.2f} | {fp / once:.2f} |")
    print(f"| one sum per tensor | {once * 1e3:.2f} | {size / once / 1e9:.2f} | 1.00 |")
    print(f"ops per check: {sum(counted.ops.values())} ({sum(counted.ops.values()) / len(params):.1f} per tensor): "
          + ", ".join(f"{k} {v}" for k, v in counted.ops.most_common()))


def _run(policy: str, steps: int, extra: list[str], where: Path) -> float:
    args = [*RUN, *extra, f"train.steps={steps}", f"train.drift_policy={policy}", f"hydra.run.dir={where}"]
    env = {k: v for k, v in os.environ.items() if k not in ("DDPTRAIN_RUN_DIR", "DDPTRAIN_FAULT")}
    subprocess.run([sys.executable, "-m", "ddptrain", *args], check=True, env=env, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads((where / "summary.json").read_text())["step_time_s"])


def runs(repeats: int, steps: int, extra: list[str]) -> None:
    times: dict[str, list[float]] = {"off": [], "abort": []}
    with tempfile.TemporaryDirectory(prefix="bench-drift-") as tmp:
        for repeat in range(repeats):
            for policy in times:
                times[policy].append(_run(policy, steps, extra, Path(tmp) / f"{policy}-{repeat}"))
    off, on = statistics.median(times["off"]), statistics.median(times["abort"])
    print(f"median steady step time of {repeats} interleaved runs of {steps} steps, a check every step "
          f"({' '.join(extra) or 'model=llama_tiny'})")
    print("| train.drift_policy | step time (s) | ratio to off |\n|---|---:|---:|")
    print(f"| off | {off:.4f} | 1.000 |\n| abort (the default) | {on:.4f} | {on / off:.3f} |")
    print(f"spread: off {min(times['off']):.4f}-{max(times['off']):.4f} s, "
          f"on {min(times['abort']):.4f}-{max(times['abort']):.4f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=["planned", "fingerprint", "runs"])
    parser.add_argument("--model", default=None, help="a model preset (planned: llama_1b, fingerprint: llama_tiny)")
    parser.add_argument("--check-every", type=int, default=10, help="planned: train.check_every")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="planned: HSDP's replica groups")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("extra", nargs="*", help="runs: overrides for every run (after --)")
    args = parser.parse_args()
    if args.suite == "planned":
        planned(args.model or "llama_1b", args.check_every, args.ranks_per_node)
    elif args.suite == "fingerprint":
        torch.set_num_threads(1)
        measure_fingerprint(args.model or "llama_tiny", max(args.repeats, 5))
    else:
        runs(args.repeats, args.steps, args.extra)


if __name__ == "__main__":
    main()
