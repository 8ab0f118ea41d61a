"""Validate the what-if predictor on this machine: calibrate from 1-rank runs, predict 2 ranks, run 2 ranks.

Weak scaling, as the predictor models it: the 2-rank runs keep each rank's work (global batch doubled).

    python scripts/validate_predictor.py --repeats 3

For each configuration the 1-rank and 2-rank runs alternate (repeats interleaved, medians reported); the link
is fitted once by ``scripts/bench_collectives.py``'s measurement on 2 gloo ranks. Every worker gets one thread,
as each of 2 ranks would on 2 cores. Prints a markdown table: predicted vs measured step and exposed comm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ddptrain.plan import Link
from ddptrain.predict import Calibration, Layout, predict

COMMON = ["data=synthetic", "parallel.wrap_single=true",  # one rank: DDP anyway, so its buckets are recorded
          "train.steps=12", "train.log_every=4", "train.eval_every=0", "logger.progress=false",
          "checkpoint.export=false", "checkpoint.every_n_steps=0"]
CONFIGS = {  # name -> overrides
    "compute-bound (llama 128x4, seq 128, one 25 MB bucket)": [
        "model.hidden_size=128", "model.num_layers=4", "data.seq_len=128", "data.micro_batch_size=8",
        "data.grad_accum=2"],
    "many small buckets (llama 64x8, seq 64, 0.05 MB buckets)": [
        "model.hidden_size=64", "model.num_layers=8", "model.num_heads=2", "model.num_kv_heads=2",
        "data.seq_len=64", "data.micro_batch_size=4", "data.grad_accum=2", "parallel.bucket_cap_mb=0.05"],
}


def _run(args: list[str], nproc: int, run_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("DDPTRAIN_RUN_DIR", None)
    micro, accum = (int(next(a for a in args if a.startswith(k)).split("=")[1])
                    for k in ("data.micro_batch_size", "data.grad_accum"))
    command = [sys.executable, "-m", "ddptrain", *COMMON, *args, f"launch.nproc_per_node={nproc}",
               f"data.global_batch_size={micro * accum * nproc}", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads((run_dir / "summary.json").read_text())


def _link() -> Link:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(__file__).parent / "bench_collectives.py"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script)], env=env, capture_output=True, text=True, check=True).stdout
    alpha, bandwidth = re.search(r"plan.latency_us=([\d.]+) plan.bandwidth_gbps=([\d.]+)", out).groups()
    return Link("measured", float(bandwidth), float(alpha), "gloo fit, 2 ranks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    link = _link()
    print(f"link: α {link.latency_us:.1f} µs, B {link.bandwidth_gbps:.3f} GB/s\n")
    print("| configuration | predicted step (ms) | measured step (ms) | error | predicted exposed (ms) | "
          "measured exposed (ms) | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CONFIGS.items():
            predicted_step, predicted_exposed, step, exposed = [], [], [], []
            for r in range(args.repeats):
                single = Path(tmp) / f"{len(name)}-1-{r}"
                _run(overrides, 1, single)
                p = predict(Calibration.from_run(str(single)), Layout(2, 1, link, link))
                predicted_step.append(p.step_s)
                predicted_exposed.append(p.exposed_s)
                measured = _run(overrides, 2, Path(tmp) / f"{len(name)}-2-{r}")
                step.append(measured["time_step_s"])
                exposed.append(measured["time_exposed_comm_s"])
            ps, ms = statistics.median(predicted_step), statistics.median(step)
            pe, me = statistics.median(predicted_exposed), statistics.median(exposed)
            print(f"| {name} | {ps * 1e3:.1f} | {ms * 1e3:.1f} | {100 * (ps - ms) / ms:+.0f}% | {pe * 1e3:.2f} | "
                  f"{me * 1e3:.2f} | {100 * (pe - me) / me:+.0f}% |", flush=True)


if __name__ == "__main__":
    main()
