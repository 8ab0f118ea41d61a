"""The CUDA autocast twin (``ddptrain/plan/memory/cuda_autocast.py``): a trace for a GPU target computes in CUDA's
autocast dtypes on the CPU, and only while it traces. An H100/H200 run validated the traced peaks against
``torch.cuda.max_memory_allocated`` with it (docs/benchmarks.md, "On a GPU"); a GPT-2 plan fell 28 % short
without it."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from ddptrain.config.compose import compose_config, typed_config
from ddptrain.plan.memory import trace as trace_module
from ddptrain.plan.memory.cuda_autocast import cuda_autocast_policy
from ddptrain.plan.memory.planner import TracedStep, checkpointing, target_device, trace_peak


def _dtypes() -> dict[str, torch.dtype]:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return {
            "pow": torch.pow(x, 3).dtype, "exp": x.exp().dtype, "layer_norm": torch.nn.functional.layer_norm(
                x, (8,)).dtype, "rms_norm": torch.nn.functional.rms_norm(x, (8,)).dtype,
            "softmax": torch.softmax(x, -1).dtype, "log_softmax": torch.log_softmax(x, -1).dtype,
            "sum": x.sum().dtype, "sum, dtype named": x.sum(dtype=torch.bfloat16).dtype,
            "linear": torch.nn.functional.linear(x, w).dtype, "mm": torch.mm(x.float(), w).dtype,
            "tanh": torch.tanh(x).dtype,
        }


CPU = dict.fromkeys(("pow", "exp", "layer_norm", "rms_norm", "softmax", "log_softmax", "sum", "sum, dtype named",
                     "linear", "mm", "tanh"), torch.bfloat16)
# CUDA's autocast: its fp32 list (pow, exp, the norms), fp32 results where no dtype is named (softmax, sum); the
# matmuls in the lower precision; ops on neither list (tanh) follow their input
CUDA = {**CPU, "pow": torch.float32, "exp": torch.float32, "layer_norm": torch.float32, "rms_norm": torch.float32,
        "softmax": torch.float32, "log_softmax": torch.float32, "sum": torch.float32}


def test_cpu_autocast_keeps_in_bf16_what_cuda_autocast_computes_in_fp32_while_the_twin_is_entered_only() -> None:
    assert _dtypes() == CPU  # torch's CPU policy, which a trace for a GPU must not follow
    with cuda_autocast_policy():
        assert _dtypes() == CUDA
    assert _dtypes() == CPU  # the registrations are gone with the context


def test_under_the_twin_autograd_records_the_cast_and_gradients_keep_their_inputs_dtype() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.pow(x, 3)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, (3 * x.float() ** 2).to(torch.bfloat16))


def _gpt2_peak(device: str) -> tuple[float, float]:
    cfg = typed_config(compose_config([
        "model=gpt2_small", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
        "data=synthetic",
        "data.seq_len=64", "data.vocab_size=512", "data.micro_batch_size=4", "data.global_batch_size=4",
        f"plan.device={device}", "train.precision=bf16"])).typed
    step = TracedStep(4, checkpointing(cfg), 2, 1, cfg.train.chunked_loss)
    peak = trace_peak(cfg, 512, step, target_device(device, None, None)).peak
    return peak.by_category["activations"], peak.peak


def test_a_trace_for_a_gpu_saves_gpt2s_fp32_gelu_and_layer_norms_as_cuda_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPT-2's tanh GELU starts with ``pow`` and its blocks with LayerNorm: fp32 on CUDA, so a GPU step saves
    more activations than the same step under the CPU's autocast."""
    activations, peak = _gpt2_peak("h100")
    monkeypatch.setattr(trace_module, "cuda_autocast_policy", nullcontext)  # the CPU's policy, as before
    cpu_policy_activations, cpu_policy_peak = _gpt2_peak("h100")
    assert activations > 1.3 * cpu_policy_activations and peak > cpu_policy_peak
