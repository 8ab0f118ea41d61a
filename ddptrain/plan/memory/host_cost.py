"""When selective activation checkpointing makes the host the bound, and what removes it.

In eager mode ``model.activation_checkpointing=selective`` runs every op of a block through torch's caching
dispatch mode, in forward and again in the recompute: per block, several times the host time of no
checkpointing, whatever the block's size (``scripts/bench_activation_checkpointing.py --suite host``). A GPU
enqueues its kernels asynchronously, so this costs nothing until a block's host time exceeds its GPU time, which
happens with small models, short sequences or small micro batches on fast GPUs. Under ``train.compile=true`` the
policy is applied when the block is traced, and the compiled block's host time is no more than eager ``none``'s
(same benchmark).

The host times below are measured on CPU (the same Python dispatch a GPU run's host does, without the CUDA
launches), on a shared 2-core machine under load (docs/benchmarks.md); a quiet, faster host takes less. They are
an estimate for a warning, not a prediction: the step-time ranking does not use them.
"""

from __future__ import annotations

from ddptrain.config.choices import ActivationCheckpointing

# Host seconds per transformer block per micro batch, forward + backward in eager mode (Llama-shaped block),
# measured at width 64 and 16 tokens where compute is negligible (docs/benchmarks.md: 2.76, 17.35, 9.46 ms).
EAGER_HOST_S_PER_BLOCK = {ActivationCheckpointing.none: 2.76e-3, ActivationCheckpointing.selective: 17.35e-3,
                          ActivationCheckpointing.full: 9.46e-3}


def selective_host_bound(checkpointing: ActivationCheckpointing, compiled: bool, block_s: float | None,
                         micro_batch: int) -> str | None:
    """The note when eager selective checkpointing's host time per block exceeds the block's predicted GPU time
    (``block_s``: forward and backward of one block at this micro batch; None without a device peak)."""
    if checkpointing != ActivationCheckpointing.selective or compiled or not block_s:
        return None
    host = EAGER_HOST_S_PER_BLOCK[checkpointing]
    if host <= block_s:
        return None
    none = EAGER_HOST_S_PER_BLOCK[ActivationCheckpointing.none]
    return (f"model.activation_checkpointing=selective in eager mode costs about {host * 1e3:.0f} ms of host time "
            f"per block per micro batch (none: {none * 1e3:.1f} ms; measured on CPU), more than the "
            f"{block_s * 1e3:.1f} ms a block computes at micro batch {micro_batch}: the host is the bound. "
            "train.compile=true applies the policy when the blocks are traced and removes that cost")
