"""The planner reproduces known figures, its formulas scale as the ZeRO and ring models say, and it renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from ddptrain.config.choices import ZERO_STAGES
from ddptrain.config.compose import build_config
from ddptrain.config.schema import Config
from ddptrain.errors import ConfigError
from ddptrain.plan.analytic.planner import (
    backward_seconds,
    build_plan,
    model_state_by_dtype,
    model_state_memory,
    step_comm,
)
from ddptrain.plan.analytic.render import render_plan
from ddptrain.plan.costs import FP32, INTERCONNECTS, MIXED_BF16, MIXED_FP16
from ddptrain.plan.whatif.layout import Layout, allreduce_seconds
from ddptrain.telemetry.peak import mfu, peak_tflops

H100 = "NVIDIA H100 80GB HBM3"


def config(**overrides: object) -> DictConfig:
    """The schema's defaults with dotted-key overrides, as Hydra would compose them."""
    cfg = OmegaConf.structured(Config)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def one_node(world_size: int) -> Layout:
    """``world_size`` ranks on one node over NVLink."""
    return Layout(world_size, 1, INTERCONNECTS["nvlink"], INTERCONNECTS["nvlink"])


@pytest.mark.parametrize(("world_size", "seconds"), [(2, 0.62), (4, 0.93), (8, 1.09), (64, 1.23)])
def test_allreduce_of_70b_fp32_gradients_over_nvlink(world_size: int, seconds: float) -> None:
    assert round(allreduce_seconds(70e9 * 4, one_node(world_size)), 2) == seconds


# bf16 compute keeps fp32 parameters, gradients and AdamW state; FSDP2 (stages 2-3) adds the bf16 gathered copy:
# all of it at stage 2, none at stage 3 when nothing is gathered.
@pytest.mark.parametrize(("stage", "bytes_per_param"), [(0, 16), (1, 8.125), (2, 2.25), (3, 0.25)])
def test_model_state_per_rank_at_64_ranks(stage: int, bytes_per_param: float) -> None:
    assert model_state_memory(1.0, 64, stage, MIXED_BF16).total == pytest.approx(bytes_per_param)


def test_fsdp2_mixed_precision_holds_fp32_shards_beside_the_bf16_gathered_copy() -> None:
    assert model_state_by_dtype(8.0, 2, 2, MIXED_BF16)["parameters"] == {"float32": 16.0, "bfloat16": 16.0}
    stage3 = model_state_by_dtype(8.0, 2, 3, MIXED_BF16, gathered=3.0)
    assert stage3 == {"parameters": {"float32": 16.0, "bfloat16": 6.0}, "gradients": {"float32": 16.0},
                      "optimizer": {"float32": 32.0}}
    assert model_state_by_dtype(8.0, 2, 3, FP32, gathered=3.0)["parameters"] == {"float32": 28.0}


def test_fp32_keeps_16_bytes_per_parameter_split_4_4_8() -> None:
    mem = model_state_memory(1.0, 1, 0, FP32)
    assert (mem.params, mem.grads, mem.optimizer) == (4, 4, 8)


def test_stage3_memory_is_inversely_proportional_to_ranks() -> None:
    totals = [model_state_memory(7e9, n, 3).total for n in (1, 2, 4, 8)]
    assert [totals[0] / t for t in totals] == pytest.approx([1, 2, 4, 8])


def test_each_stage_needs_no_more_memory_than_the_previous() -> None:
    totals = [model_state_memory(7e9, 8, s).total for s in ZERO_STAGES]
    assert totals == sorted(totals, reverse=True)


def test_one_rank_does_not_communicate_and_ddp_memory_does_not_shrink_with_ranks() -> None:
    assert all(step_comm(7e9, 1, s).nbytes == 0 for s in ZERO_STAGES)
    assert model_state_memory(7e9, 64, 0) == model_state_memory(7e9, 1, 0)


def test_zero3_sends_one_and_a_half_times_ddp_in_fp32_and_as_much_with_bf16_gathers() -> None:
    assert step_comm(7e9, 8, 3, FP32).nbytes == pytest.approx(1.5 * step_comm(7e9, 8, 0, FP32).nbytes)
    assert step_comm(7e9, 8, 1, FP32) == step_comm(7e9, 8, 2, FP32) == step_comm(7e9, 8, 0, FP32)
    assert step_comm(7e9, 8, 3, MIXED_BF16).nbytes == pytest.approx(step_comm(7e9, 8, 0, MIXED_BF16).nbytes)


def test_allreduce_latency_term_grows_with_ranks() -> None:
    assert allreduce_seconds(0.0, one_node(8)) == pytest.approx(14 * 3e-6)


def test_backward_is_two_thirds_of_training_compute() -> None:
    # 6e12 FLOP per token × 1 token at 100% of 1 TFLOP/s: 6 s of training, 4 s of it backward.
    assert backward_seconds(6e12, 1, peak_tflops=1.0, mfu=1.0) == pytest.approx(4.0)


def test_peak_lookup_by_cuda_device_name() -> None:
    assert peak_tflops(H100) == 989
    assert peak_tflops("NVIDIA H100 PCIe") == 756
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert peak_tflops("NVIDIA L4") == 121
    assert peak_tflops("NVIDIA L40S") == 362
    assert peak_tflops("cpu") is None


def test_mfu_is_absent_for_an_unknown_peak_and_never_above_one() -> None:
    assert mfu(400.0, 989.0) == pytest.approx(400 / 989)
    assert mfu(400.0, None) is None
    assert mfu(1000.0, 989.0) is None


def test_70b_on_8_gpus_planned_by_params_alone_renders() -> None:
    cfg = config(
        **{
            "plan.params": 70e9,
            "parallel.zero_stage": 3,
            "data.seq_len": 4096,
            "data.global_batch_size": 64,
            "data.micro_batch_size": 2,
        }
    )
    plan = build_plan(cfg, world_size=8, device_name=H100)
    assert plan.flops_per_token == 6 * 70e9
    assert plan.batch.grad_accum == 4
    assert plan.precision == MIXED_BF16
    assert plan.memory[3].total == pytest.approx(2 * 70e9)
    text = render_plan(plan)
    for line in (
        "70.00 G parameters (plan.params)",
        "global batch 64 = micro batch 2 x grad accum 4 x dp 8",
        "ZeRO-3 ←",
        "130.39 GiB",
        "Communication per rank per step: 490.00 GB",
        "nvlink",
        "infiniband_ndr",
        "pcie_gen5",
        "hides under backward",
    ):
        assert line in text


def test_a_prompt_completion_plan_counts_the_real_tokens_and_attention_its_measured_run_saw(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"tokens_per_sequence": 20.0, "attended_tokens": 25.0}))
    shape = {"model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 4, "data.seq_len": 64,
             "data.micro_batch_size": 4, "data.global_batch_size": 8, "metrics.peak_tflops": 100.0}
    blocks = build_plan(config(**shape), world_size=2, device_name=None)
    rows = build_plan(config(**shape, **{"data.format": "prompt_completion", "plan.from_run": str(tmp_path)}),
                      world_size=2, device_name=None)
    attention = 12 * 2 * 4 * 16  # 12·L·H·Q, per token per token attended over
    assert blocks.flops_per_token - rows.flops_per_token == attention * (64 - 25)
    assert (blocks.sequence_tokens, rows.sequence_tokens) == (64, 20)
    assert blocks.backward_s is not None and rows.backward_s is not None
    assert rows.backward_s == pytest.approx(blocks.backward_s * (20 * rows.flops_per_token)
                                            / (64 * blocks.flops_per_token))
    assert "Σ T² / Σ T = 25.0" in " ".join(render_plan(rows).split())  # the rule says what it counted
    unmeasured = build_plan(config(**shape, **{"data.format": "prompt_completion"}), world_size=2, device_name=None)
    assert (unmeasured.flops_per_token, unmeasured.sequence_tokens) == (blocks.flops_per_token, 64)


def test_cpu_plan_of_the_default_model_uses_fp32_and_a_measured_bandwidth() -> None:
    plan = build_plan(config(**{"plan.bandwidth_gbps": 1.5}), world_size=2, device_name=None)
    assert plan.precision == FP32
    assert plan.link.name == "measured"
    assert plan.overlap_ratio is None
    text = render_plan(plan)
    assert "measured" in text and "1.5 GB/s" in text
    assert "unknown device peak" in text


def test_slow_link_cannot_hide_the_sync() -> None:
    cfg = config(**{"plan.params": 7e9, "plan.interconnect": "pcie_gen5", "data.micro_batch_size": 1})
    plan = build_plan(cfg, world_size=8, device_name=H100)
    assert plan.overlap_ratio is not None and plan.overlap_ratio > 1
    assert "cannot hide" in render_plan(plan)


def test_unknown_interconnect_is_a_config_error() -> None:
    expected = r"plan\.interconnect='carrier_pigeon': expected one of nvlink, infiniband_ndr"
    with pytest.raises(ConfigError, match=expected):
        build_config({"plan": {"interconnect": "carrier_pigeon"}})


@pytest.mark.parametrize(("precision", "gpu", "bf16_capable", "expected"),
                         [("auto", H100, True, MIXED_BF16), ("auto", "T4", False, MIXED_FP16),
                          ("fp16", H100, True, MIXED_FP16), ("auto", None, True, FP32), ("fp32", "T4", False, FP32)])
def test_precision_auto_is_fp16_on_a_gpu_without_bf16_and_fp16_gathers_fp32(
    precision: str, gpu: str | None, bf16_capable: bool, expected: object
) -> None:
    plan = build_plan(config(**{"train.precision": precision}), world_size=2, device_name=gpu,
                      bf16_capable=bf16_capable)
    assert plan.precision == expected
    assert MIXED_FP16.gathered_bytes == 4  # FSDP2 runs fp16 without a mixed-precision policy: fp32 gathered
