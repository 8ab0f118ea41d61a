"""What a step costs, shared by every planner: bytes per parameter of the state a run keeps (``StateBytes``),
the bytes a rank sends (``Comm``) and the α–β links they cross (``Link``, the interconnect presets)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from omegaconf import DictConfig

from ddptrain.config.schema import PlanConfig
from ddptrain.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the state a ddptrain run keeps: the parameters the optimizer updates, their gradients
    and the AdamW state; plus the working copy that FSDP2 (ZeRO-2/3) gathers for compute, in its own dtype.

    bf16 compute never changes the first three: DDP and ZeRO-1 run bf16 under autocast on fp32 parameters, and
    FSDP2's mixed-precision policy gathers bf16 from fp32 shards and reduce-scatters gradients in fp32.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    gathered_bytes: int
    gathered_dtype: str


MIXED_BF16 = StateBytes("bf16 compute: fp32 parameters, gradients and AdamW; FSDP2 gathers bf16", 4, 4, 8, 2,
                       "bfloat16")
FP32 = StateBytes("fp32, AdamW", 4, 4, 8, 4, "float32")
# fp16 autocast with a loss scaler (GPUs without bf16): FSDP2 runs without a mixed-precision policy there, so it
# gathers the fp32 parameters and autocast casts them, as under DDP.
MIXED_FP16 = StateBytes("fp16 compute, loss-scaled: fp32 parameters, gradients and AdamW; FSDP2 gathers fp32", 4, 4,
                       8, 4, "float32")


@dataclass(frozen=True)
class Comm:
    """Bytes one rank sends in a step, and the ring steps that each pay the latency α."""

    nbytes: float
    hops: int


@dataclass(frozen=True)
class Link:
    """An interconnect in the α–β model: per-hop latency α and bus bandwidth B."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    note: str

    def seconds(self, comm: Comm) -> float:
        """t = hops·α + bytes/B."""
        return comm.hops * self.latency_us * 1e-6 + comm.nbytes / (self.bandwidth_gbps * GB)


# B is bus bandwidth, the rate each rank sends at in a ring (nccl-tests' busbw), so one direction of a link.
# α: assumed per-hop latencies, of the order NCCL's own cost model (src/graph/tuning.cc) uses for ring collectives.
INTERCONNECTS: dict[str, Link] = {
    "nvlink": Link("nvlink", 450.0, 3.0, "H100 NVLink 4: 900 GB/s is both directions; nccl-tests all-reduce busbw "
                   "on 8 H100 SXM reaches ~450-480 GB/s"),
    "infiniband_ndr": Link("infiniband_ndr", 50.0, 10.0, "one 400 Gb/s NDR port per GPU, line rate (an upper bound)"),
    "pcie_gen5": Link("pcie_gen5", 28.0, 5.0, "assumed effective ring bandwidth; the x16 line rate is 64 GB/s"),
}


def preset_link(key: str, name: str) -> Link:
    """The interconnect preset ``name``, or a ConfigError naming the key ``key``."""
    if name not in INTERCONNECTS:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


def chosen_link(cfg: PlanConfig | DictConfig) -> Link:
    """``plan.interconnect``'s preset or a measured bus bandwidth (``plan.bandwidth_gbps``); α ``plan.latency_us``."""
    preset = preset_link("plan.interconnect", cfg.interconnect)
    alpha = preset.latency_us if cfg.latency_us is None else cfg.latency_us
    if cfg.bandwidth_gbps:
        return Link("measured", cfg.bandwidth_gbps, alpha, "plan.bandwidth_gbps")
    return replace(preset, latency_us=alpha)
