"""Fit the α–β model of this process group's all-reduce, for the what-if predictor:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 scripts/bench_collectives.py

prints α and the bus bandwidth B, and the overrides that feed them to ``launch.dry_run=true plan.from_run=...``.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from ddptrain.comm.linkfit import measure_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    link = measure_link(repeats=args.repeats)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks ({dist.get_backend()}): α {link.latency_us:.1f} µs per hop, "
              f"bus bandwidth {link.bandwidth_gbps:.3f} GB/s")
        print(f"plan.latency_us={link.latency_us:.2f} plan.bandwidth_gbps={link.bandwidth_gbps:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
