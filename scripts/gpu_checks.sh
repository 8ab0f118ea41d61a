#!/usr/bin/env bash
# Every check that needs a CUDA device, in one command on one GPU (about 8 minutes on an H100), most important
# first, each under its own time limit so that one stuck step costs only its own:
#   1. the image's checks of the installed torch (a CUDA build; C against Python.h compiles for Triton)
#   2. the gpu-marked tests (pytest -m gpu)
#   3. the chunked loss's head at Qwen3-4B's size: chunk sizes against full logits (bench_chunked_head.py)
#   4. real runs through the CLI on the GPU: the quickstart, LoRA and QLoRA (NF4) on its exported model, and
#      data.micro_batch_size=auto on the device's own memory (summary.json: planned against measured peak)
#   5. the fused Triton kernels against the torch sequences they replace (bench_kernels.py)
#   6. tokens/s, MFU and synchronizing calls per step, eager and compiled (bench_gpu.py; its table is written
#      into docs/benchmarks.md, copied to OUT_DIR)
# Everything it prints goes to OUT_DIR/gpu_checks.log too; the runs' summaries and metrics to OUT_DIR/runs.tgz.
#   scripts/gpu_checks.sh OUT_DIR [SECONDS]     # SECONDS: the whole budget (default 480); the last step gets the rest
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [SECONDS]}
budget=${2:-480}
mkdir -p "$out"
work=$(mktemp -d)
exec > >(tee "$out/gpu_checks.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled HF_HUB_OFFLINE=1

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs it under the limit (capped by what is left of the budget)
    local name=$1 limit=$2 left=$((budget - SECONDS - 5))
    shift 2
    ((limit > left)) && limit=$left
    if ((limit < 10)); then echo "=== $name: skipped (budget spent)"; return; fi
    echo "=== $name (at ${SECONDS} s, limit ${limit} s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    echo "=== $name: rc=$? in $((SECONDS - t0)) s"
}

step environment 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv;
    python3 -c "import sys, torch, transformers, triton, peft; print(sys.version.split()[0], torch.__version__,
    torch.version.cuda, transformers.__version__, triton.__version__, peft.__version__)"'
step image-checks 60 bash -c 'python3 -c "import torch; assert torch.version.cuda, torch.__version__" &&
    python3 -c "import subprocess, sysconfig; subprocess.run([\"gcc\", \"-fsyntax-only\", \"-x\", \"c\", \"-I\",
    sysconfig.get_paths()[\"include\"], \"-\"], input=b\"#include <Python.h>\n\", check=True)" && echo image checks pass'
# the files that hold gpu-marked tests (collecting every file would need the test extra's CPU-only packages)
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
step gpu-tests 200 python3 -m pytest -m gpu -p no:randomly -q -rA --junitxml="$out/gpu_tests.xml" "${gpu_files[@]}"
step chunked-head 90 bash -o pipefail -c "python3 scripts/bench_chunked_head.py | tee '$out/chunked_head.md'"
step quickstart 120 ddptrain +experiment=quickstart launch.nproc_per_node=1 hydra.run.dir="$work/quickstart"
step lora 90 ddptrain +experiment=lora_quickstart launch.nproc_per_node=1 model.pretrained="$work/quickstart/model" \
    hydra.run.dir="$work/lora"
step qlora 90 ddptrain +experiment=lora_quickstart launch.nproc_per_node=1 model.pretrained="$work/quickstart/model" \
    model.quantize=nf4 hydra.run.dir="$work/qlora"
step auto-micro-batch 150 ddptrain +experiment=gpt2_small launch.nproc_per_node=1 data=synthetic \
    data.micro_batch_size=auto data.global_batch_size=256 train.steps=12 train.log_every=4 train.eval_every=0 \
    checkpoint.every_n_steps=0 hydra.run.dir="$work/auto"
step kernels 90 bash -o pipefail -c "python3 scripts/bench_kernels.py --repeats 5 | tee '$out/kernels.md'"
step bench-gpu 400 torchrun --standalone --nproc-per-node=1 scripts/bench_gpu.py --models gpt2_small llama_1b \
    --steps 30 --write docs/benchmarks.md
cp docs/benchmarks.md "$out/benchmarks.md"
(cd "$work" && find . \( -name 'summary.json' -o -name '*.jsonl' -o -name 'plan.json' -o -name '*.log' \) \
    -size -20M -print0 | tar --null -czf "$out/runs.tgz" -T -)
echo "=== done at ${SECONDS} s"
