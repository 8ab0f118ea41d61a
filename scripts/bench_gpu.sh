#!/usr/bin/env bash
# One command, one CUDA device: tokens/s and MFU of gpt2_small and llama_1b, eager vs compiled blocks (bf16),
# and the synchronizing CUDA calls per steady step; the table is written into docs/benchmarks.md.
#   scripts/bench_gpu.sh                  # both models, 40 steps each mode
#   scripts/bench_gpu.sh --models gpt2_small --steps 60
set -euo pipefail
cd "$(dirname "$0")/.."
exec torchrun --standalone --nproc-per-node=1 scripts/bench_gpu.py --write docs/benchmarks.md "$@"
