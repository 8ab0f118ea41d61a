"""Model-state memory under FSDP2 with a bf16 mixed-precision policy: what each rank holds, by dtype.

FSDP2 keeps every parameter's fp32 shard (the copy AdamW updates) and gathers a bf16 working copy for compute:
all of it from forward to the end of backward at ZeRO-2, the root's and one block's at a time at ZeRO-3. The
probe counts both, and the planner's formula says the same. Two ranks of torch's in-process fake process group
stand for a real group: the bytes held do not depend on what the collectives compute.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ddptrain.config.schema import ModelConfig, ParallelConfig
from ddptrain.models import build_model
from ddptrain.parallel.zero import shard_model
from ddptrain.plan.analytic.planner import model_state_by_dtype
from ddptrain.plan.costs import FP32, MIXED_BF16
from ddptrain.telemetry.memory import ModelStateProbe, largest_gather
from tests.helpers.tiny import TINY_MODEL

WORLD, VOCAB = 2, 256
CPU = torch.device("cpu")
TINY = ModelConfig(**TINY_MODEL, max_position_embeddings=64)


@pytest.fixture
def fake_group() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _first_step(
    stage: int, precision: str, device: torch.device = CPU
) -> tuple[dict[str, dict[str, int]], int]:
    """One step of ZeRO-``stage`` under train.precision ``precision``: what the probe read, and the gathered count."""
    torch.manual_seed(0)
    model = build_model(TINY, VOCAB, eos_id=0).to(device)
    shard_model(model, ParallelConfig(zero_stage=stage), device, precision)
    optimizer = torch.optim.AdamW(model.parameters())
    probe = ModelStateProbe(model)
    ids = torch.randint(0, VOCAB, (2, 16), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    probe.after_backward()
    optimizer.step()
    probe.after_step(optimizer)
    return probe.bytes, probe.gathered


def _root_and_one_block() -> int:
    """Parameters outside the transformer blocks plus one block's, counted by name on the plain model."""
    model = build_model(TINY, VOCAB, eos_id=0)
    return sum(p.numel() for name, p in model.named_parameters() if ".layers." not in name or ".layers.0." in name)


N_PARAMS = sum(p.numel() for p in build_model(TINY, VOCAB, eos_id=0).parameters())


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_bf16_holds_fp32_shards_and_the_gathered_bf16_copy(fake_group: None, stage: int) -> None:
    held, largest = _first_step(stage, "bf16")
    assert largest == _root_and_one_block()
    # Worked out by hand: fp32 shards of everything, bf16 of what is gathered, fp32 sharded gradients and AdamW.
    gathered = N_PARAMS if stage == 2 else largest
    expected = {"parameters": {"float32": 4 * N_PARAMS / WORLD, "bfloat16": 2 * gathered},
                "gradients": {"float32": 4 * N_PARAMS / WORLD}, "optimizer": {"float32": 8 * N_PARAMS / WORLD}}
    for component, by_dtype in expected.items():  # storage padding to a multiple of the world size: under 5%
        assert held[component] == pytest.approx(by_dtype, rel=0.05), component
    assert model_state_by_dtype(N_PARAMS, WORLD, stage, MIXED_BF16, largest) == expected


@pytest.mark.parametrize("stage", [2, 3])
def test_without_a_policy_the_gathered_copy_is_fp32_too(fake_group: None, stage: int) -> None:
    held, gathered = _first_step(stage, "fp32")
    formula = model_state_by_dtype(N_PARAMS, WORLD, stage, FP32, gathered)
    assert held["parameters"].keys() == {"float32"}
    for component, by_dtype in formula.items():
        assert held[component] == pytest.approx(by_dtype, rel=0.05), component


@pytest.fixture
def nccl_group() -> Iterator[None]:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.usefixtures("nccl_group")
@pytest.mark.gpu
def test_on_cuda_auto_precision_holds_fp32_shards_and_the_gathered_bf16_copy(stage: int) -> None:
    held, largest = _first_step(stage, "auto", torch.device("cuda", 0))  # auto: the bf16 policy on CUDA
    formula = model_state_by_dtype(N_PARAMS, 1, stage, MIXED_BF16, largest)
    for component, by_dtype in formula.items():
        assert held[component] == pytest.approx(by_dtype, rel=0.05), component


def test_largest_gather_without_fsdp_is_the_whole_model() -> None:
    assert largest_gather(build_model(TINY, VOCAB, eos_id=0)) == N_PARAMS
