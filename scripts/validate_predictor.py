"""Validate the what-if predictor on this machine: calibrate from 1-rank runs, predict 2 ranks, run 2 ranks.

Weak scaling, as the predictor models it: the 2-rank runs keep each rank's work (global batch doubled).

    PYTHONPATH=. python scripts/validate_predictor.py --repeats 3   # on a machine with nothing else running

Each repeat measures the process group first (``scripts/bench_collectives.py`` on 2 gloo ranks: the α–β link
and the CPU host fit of ``scripts/cpu_host_fit.py``, the predictor's host terms for ranks sharing 2 cores), then
runs every configuration on 1 rank and on 2 ranks; each 2-rank run is predicted from that repeat's 1-rank run
and measurement, never from its own communication times. Every worker gets one thread,
as each of 2 ranks would on 2 cores. Prints a markdown table of medians (predicted vs measured step and exposed
communication), what each modelled term added to the prediction, and each phase's time on 1 and 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_host_fit import HostFit  # this directory's module (a script's directory is on sys.path)

from ddptrain.plan.costs import Link
from ddptrain.plan.whatif import Calibration, Layout, predict

ROOT = Path(__file__).resolve().parents[1]
# 36 steps logged every 4: summary.json's figures are medians over the 8 windows after the first (warm-up),
# where 12 steps gave 2, too few to pin the exposed communication of a step (tens of ms, jittered by ms)
COMMON = ["data=synthetic", "parallel.wrap_single=true",  # one rank: DDP anyway, so its buckets are recorded
          "train.steps=36", "train.log_every=4", "train.eval_every=0", "logger.progress=false",
          "checkpoint.export=false", "checkpoint.every_n_steps=0"]
CONFIGS = {  # name -> overrides
    "compute-bound (llama 128x4, seq 128, one 7.4 MB bucket)": [
        "model.hidden_size=128", "model.num_layers=4", "data.seq_len=128", "data.micro_batch_size=8",
        "data.grad_accum=2"],
    "many small buckets (llama 64x8, seq 64, 0.05 MB buckets)": [
        "model.hidden_size=64", "model.num_layers=8", "model.num_heads=2", "model.num_kv_heads=2",
        "data.seq_len=64", "data.micro_batch_size=4", "data.grad_accum=2", "parallel.bucket_cap_mb=0.05"],
}
PHASES = ("time_data_s", "time_forward_sync_s", "time_forward_s", "time_backward_s", "time_exposed_comm_s",
          "time_optimizer_s", "time_step_s", "comm_time_s")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _run(args: list[str], nproc: int, run_dir: Path) -> dict:
    env = {k: v for k, v in ENV.items() if k != "DDPTRAIN_RUN_DIR"}
    micro, accum = (int(next(a for a in args if a.startswith(k)).split("=")[1])
                    for k in ("data.micro_batch_size", "data.grad_accum"))
    command = [sys.executable, "-m", "ddptrain", *COMMON, *args, f"launch.nproc_per_node={nproc}",
               f"data.global_batch_size={micro * accum * nproc}", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads((run_dir / "summary.json").read_text())


def _measure(out: Path) -> tuple[Link, HostFit]:
    """The α–β link and host terms of 2 gloo ranks, as ``scripts/bench_collectives.py`` measures them."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "scripts" / "bench_collectives.py"), "--host-repeats", "21", "--json", str(out)],
                   env=ENV, capture_output=True, text=True, check=True)
    fit = json.loads(out.read_text())
    return Link(**fit["link"]), HostFit(**fit["host"])


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, dict[str, list]] = {name: {"pred": [], "ones": [], "twos": []} for name in CONFIGS}
    fits = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            link, host = _measure(Path(tmp) / f"fit-{r}.json")
            fits.append((link, host))
            for c, (name, overrides) in enumerate(CONFIGS.items()):
                single = Path(tmp) / f"{c}-1-{r}"
                rows[name]["ones"].append(_run(overrides, 1, single))
                rows[name]["pred"].append(predict(Calibration.from_run(str(single)), Layout(2, 1, link, link), host))
                rows[name]["twos"].append(_run(overrides, 2, Path(tmp) / f"{c}-2-{r}"))
    for link, host in fits:
        print(f"<!-- fit: α {link.latency_us:.0f} µs, B {link.bandwidth_gbps:.3f} GB/s, contention "
              f"x{host.contention:.2f}, steal {host.steal_us_per_mb:.0f} µs/MB, wait {host.skew_us:.0f} µs + skew "
              f"{host.skew:.3f}, beside compute α "
              f"{host.busy_latency_us:.0f} µs, B {host.busy_bandwidth_gbps:.3f} GB/s, queued α "
              f"{host.queued_latency_us:.0f} µs -->")
    print("\n| configuration | predicted step (ms) | measured step (ms) | error | predicted exposed (ms) | "
          "measured exposed (ms) | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        ps = statistics.median(p.step_s for p in row["pred"])
        pe = statistics.median(p.exposed_s for p in row["pred"])
        ms = statistics.median(m["time_step_s"] for m in row["twos"])
        me = statistics.median(m["time_exposed_comm_s"] for m in row["twos"])
        print(f"| {name} | {ps * 1e3:.1f} | {ms * 1e3:.1f} | {100 * (ps - ms) / ms:+.0f}% | {pe * 1e3:.1f} | "
              f"{me * 1e3:.1f} | {100 * (pe - me) / me:+.0f}% |")
    for name, row in rows.items():
        terms = ", ".join(f"{k[:-2]} {_ms([p.terms[k] for p in row['pred']])}" for k in row["pred"][0].terms)
        print(f"\n{name}: terms added (ms, medians): {terms}")
        own = [m["predicted"] for m in row["twos"]]
        print(f"  2-rank runs' own prediction (gloo default link): step error "
              f"{statistics.median(o['step_error_pct'] for o in own):+.0f}%, exposed error "
              f"{statistics.median(o['exposed_comm_error_pct'] for o in own):+.0f}%; rank skew "
              f"{statistics.median(m.get('rank_skew_pct', 0.0) for m in row['twos']):.1f}%")
        print(f"  in flight per step (ms): predicted {_ms([p.comm_s for p in row['pred']])}, measured "
              f"{_ms([m['comm_time_s'] for m in row['twos']])}")
        print("  measured exposed per repeat (ms): " + ", ".join(f"{m['time_exposed_comm_s'] * 1e3:.1f}"
                                                               for m in row["twos"]))
        for n, runs in (("1 rank ", row["ones"]), ("2 ranks", row["twos"])):
            print(f"  {n}: " + ", ".join(f"{k[5:-2]} {_ms([m.get(k, 0.0) for m in runs])}" for k in PHASES))


if __name__ == "__main__":
    main()
