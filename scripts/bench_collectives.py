"""Measure this process group for the what-if predictor: the α–β fit of its all-reduce and the CPU host fit.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 scripts/bench_collectives.py

prints α and the bus bandwidth B, then the ``plan.*`` overrides that feed the link to
``launch.dry_run=true plan.from_run=...``. It also prints the CPU host fit (``cpu_host_fit.py``: how much the
ranks slow each other's compute, what an in-flight collective takes from compute, the wait for the slowest rank
and α, B of all-reduces that run beside compute), which only ``scripts/validate_predictor.py`` uses: ranks that
share CPU cores with gloo need it, a GPU per rank does not. ``--json PATH`` also writes both as one record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch.distributed as dist
from cpu_host_fit import measure_host  # this directory's module (a script's directory is on sys.path)
from linkfit import measure_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--host-repeats", type=int, default=7, help="rounds of the host terms' measurement")
    parser.add_argument("--json", type=Path, default=None, help="also write the fit here (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    link = measure_link(repeats=args.repeats)
    host = measure_host(repeats=args.host_repeats)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks ({dist.get_backend()}): α {link.latency_us:.1f} µs per hop, "
              f"bus bandwidth {link.bandwidth_gbps:.3f} GB/s; CPU host fit: contention x{host.contention:.2f}, "
              f"steal {host.steal_us_per_mb:.0f} µs/MB, wait {host.skew_us:.0f} µs + {host.skew:.1%} of compute; "
              f"beside compute: α "
              f"{host.busy_latency_us:.1f} µs, {host.busy_bandwidth_gbps:.3f} GB/s, queued behind one in flight α "
              f"{host.queued_latency_us:.1f} µs")
        print(f"plan.latency_us={link.latency_us:.2f} plan.bandwidth_gbps={link.bandwidth_gbps:.4f}")
        if args.json:
            args.json.write_text(json.dumps({"link": dataclasses.asdict(link), "host": dataclasses.asdict(host)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
