#!/bin/bash
# ddptrain on several hosts without a scheduler: run this once on every host (same arguments everywhere).
#
#   host A:  NNODES=2 NODE_RANK=0 MASTER_ADDR=hostA scripts/multinode.sh +experiment=gpt2_small
#   host B:  NNODES=2 NODE_RANK=1 MASTER_ADDR=hostA scripts/multinode.sh +experiment=gpt2_small
#
# The torchrun agents meet at a c10d rendezvous on MASTER_ADDR:MASTER_PORT. GPUS_PER_NODE defaults to the
# GPUs nvidia-smi lists (1 without it). RUN_ID names the rendezvous; keep it equal on every host.
# DDPTRAIN_RUN_DIR must name the same directory on a filesystem every host mounts (checkpoints need it);
# unset, rank 0 picks outputs/<time> under its working directory.
set -euo pipefail

nnodes=${NNODES:?set NNODES, the number of hosts}
node_rank=${NODE_RANK:?set NODE_RANK, this host\'s index from 0}
master_addr=${MASTER_ADDR:?set MASTER_ADDR, the first host\'s address}
master_port=${MASTER_PORT:-29500}
run_id=${RUN_ID:-ddptrain}
if [[ -z ${GPUS_PER_NODE:-} ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
  else
    GPUS_PER_NODE=1
  fi
fi

exec torchrun --nnodes="$nnodes" --nproc-per-node="$GPUS_PER_NODE" --node-rank="$node_rank" \
  --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="$run_id" \
  -m ddptrain "$@"
