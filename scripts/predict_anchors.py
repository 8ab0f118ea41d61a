"""Predict Llama 3.1 8B on 8, 64 and 128 H100s with FSDP, beside torchtitan's published throughput:

    python scripts/predict_anchors.py [--mfu 0.40]

Anchor: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (FSDP, no compile, no
Float8; local batch 2, sequence 8192, selective activation checkpointing; Grand Teton hosts of 8 H100s on NVLink,
400 Gb/s RDMA per GPU): 5,762 tokens/s per GPU on 8 GPUs, 5,605 on 128. No 64-GPU figure is published.

How: one GPU's compute per step is calibrated so that the predicted 8-GPU step equals the anchor's (the MFU that
implies is printed, against torchtitan's own 33-39%), or set from ``--mfu``; the 64 and 128 GPUs are predicted.
FSDP's collectives per transformer block (bf16 parameters, fp32 gradient reduction, torchtitan's defaults) go on
the predictor's overlap timeline: the forward all-gather (one ring pass of 2 bytes/parameter) behind the forward
compute of the block before it, the backward all-gather plus reduce-scatter (2 + 4 bytes/parameter) behind the
backward compute of the blocks that follow. Forward is 1/3 of compute, split over blocks by parameters. Links:
the ``nvlink`` and ``infiniband_ndr`` presets; 1-D FSDP over several nodes is one flat ring (NCCL's rings cross
the nodes, each GPU on its own NIC). Host terms: a GPU per rank (none). Not measured on a GPU.
"""

from __future__ import annotations

import argparse

from ddptrain.config.schema import ModelConfig
from ddptrain.models.flops import count_params, flops_per_token
from ddptrain.plan.costs import INTERCONNECTS
from ddptrain.plan.whatif.layout import Layout, collective_seconds
from ddptrain.plan.whatif.overlap import sync_timeline

MODEL = ModelConfig(name="llama3_8b", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=14336, max_position_embeddings=8192, vocab_size=128256, tie_embeddings=False)
SEQ, LOCAL_BATCH, PEAK = 8192, 2, 989e12  # H100 SXM bf16 dense peak, as torchtitan computes MFU
ANCHORS = {8: 5762.0, 128: 5605.0}  # tokens/s per GPU, torchtitan FSDP (Tables 1 and 3)
GPUS_PER_NODE = 8


def _units() -> list[int]:
    """Parameters of FSDP's units in forward order: embedding, the blocks, then norm + output projection."""
    counts = count_params(MODEL, MODEL.vocab_size or 0)
    block = (counts.non_embedding - MODEL.hidden_size) // MODEL.num_layers
    head = MODEL.vocab_size * MODEL.hidden_size + MODEL.hidden_size  # type: ignore[operator]
    return [MODEL.vocab_size * MODEL.hidden_size] + [block] * MODEL.num_layers + [head]  # type: ignore[operator]


def step_seconds(compute: float, layout: Layout) -> tuple[float, float]:
    """(step, exposed communication) of one GPU's FSDP step of ``compute`` seconds on ``layout``."""
    units = _units()
    total = sum(units)
    share = [compute * n / total for n in units]  # each unit's compute, by its parameters
    one_pass = lambda nbytes: collective_seconds(nbytes, layout, 1)  # noqa: E731
    # forward: unit i's all-gather may start when unit i-1's forward starts (one unit of prefetch)
    fwd = [share_i / 3 for share_i in share]
    starts = [sum(fwd[:i]) for i in range(len(fwd))]
    forward = sync_timeline([(sum(fwd) - starts[max(0, i - 1)], 2 * n) for i, n in enumerate(units)], one_pass)
    # backward, in reverse: a unit's gradients reduce-scatter (and the next unit's parameters gather) after it
    bwd = [2 * share_i / 3 for share_i in reversed(share)]
    ends = [sum(bwd[: i + 1]) for i in range(len(bwd))]
    backward = sync_timeline([(sum(bwd) - end, 6 * n) for end, n in zip(ends, reversed(units), strict=True)],
                             one_pass)
    exposed = forward.exposed_s + backward.exposed_s
    return compute + exposed, exposed


def layouts(gpus: int) -> tuple[Layout, Layout]:
    """(flat ring, hierarchical) layouts of ``gpus`` H100s, 8 per node."""
    nodes = max(1, gpus // GPUS_PER_NODE)
    intra, inter = INTERCONNECTS["nvlink"], INTERCONNECTS["infiniband_ndr"]
    return Layout(gpus, nodes, intra, inter, hierarchical=False), Layout(gpus, nodes, intra, inter, hierarchical=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=None, help="set compute from this MFU instead of the 8-GPU anchor")
    args = parser.parse_args()
    tokens = LOCAL_BATCH * SEQ
    fpt = flops_per_token(MODEL, MODEL.vocab_size or 0, SEQ)
    if args.mfu:
        compute, source = tokens * fpt / (PEAK * args.mfu), f"--mfu {args.mfu:.2f}"
    else:  # the compute whose predicted 8-GPU step is the anchor's
        target, compute = tokens / ANCHORS[8], tokens / ANCHORS[8]
        for _ in range(50):
            compute = target - step_seconds(compute, layouts(8)[0])[1]
        source = "the 8-GPU anchor"
    print(f"Llama 3.1 8B: {sum(_units()) / 1e9:.2f} B parameters, {fpt / 1e9:.1f} GFLOP per token at sequence {SEQ}; "
          f"{tokens} tokens per GPU per step; compute {compute:.3f} s per step from {source} = "
          f"{tokens * fpt / compute / PEAK:.1%} MFU of {PEAK / 1e12:.0f} TFLOP/s (torchtitan reports 33-39%)")
    for name in ("nvlink", "infiniband_ndr"):
        link = INTERCONNECTS[name]
        print(f"link {name}: {link.bandwidth_gbps:g} GB/s bus bandwidth, α {link.latency_us:g} µs ({link.note})")
    print("\n| GPUs | layout | predicted tokens/s/GPU (flat ring) | exposed comm | hierarchical | "
          "torchtitan tokens/s/GPU | error |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for gpus in (8, 64, 128):
        flat, hier = layouts(gpus)
        step, exposed = step_seconds(compute, flat)
        anchor = ANCHORS.get(gpus)
        error = f"{100 * (tokens / step - anchor) / anchor:+.1f}%" if anchor else "-"
        print(f"| {gpus} | {flat.describe()} | {tokens / step:,.0f} | {exposed * 1e3:.0f} ms | "
              f"{tokens / step_seconds(compute, hier)[0]:,.0f} | {f'{anchor:,.0f}' if anchor else '-'} | {error} |")


if __name__ == "__main__":
    main()
