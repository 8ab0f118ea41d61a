"""The CUDA autocast twin (``ddptrain/plan/memory/cuda_autocast.py``): a trace for a GPU target computes in CUDA's
autocast dtypes on the CPU, and only while it traces. An H100/H200 run validated the traced peaks against
``torch.cuda.max_memory_allocated`` with it (docs/benchmarks.md, "On a GPU"); a GPT-2 plan fell 28 % short
without it."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from ddptrain.config.compose import compose_config, typed_config
from ddptrain.plan.memory import trace as trace_module
from ddptrain.plan.memory.cuda_autocast import _fp32_result_kernel, cuda_autocast_policy
from ddptrain.plan.memory.planner import TracedStep, checkpointing, target_device, trace_peak


def _dtypes(lower: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    x = torch.randn(4, 8, dtype=lower)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=lower):
        return {
            "pow": torch.pow(x, 3).dtype, "exp": x.exp().dtype, "layer_norm": torch.nn.functional.layer_norm(
                x, (8,)).dtype, "rms_norm": torch.nn.functional.rms_norm(x, (8,)).dtype,
            "softmax": torch.softmax(x, -1).dtype, "log_softmax": torch.log_softmax(x, -1).dtype,
            "sum": x.sum().dtype, "sum, dtype named": x.sum(dtype=lower).dtype,
            "linear": torch.nn.functional.linear(x, w).dtype, "mm": torch.mm(x.float(), w).dtype,
            "tanh": torch.tanh(x).dtype,
        }


OPS = ("pow", "exp", "layer_norm", "rms_norm", "softmax", "log_softmax", "sum", "sum, dtype named", "linear", "mm",
       "tanh")
# CUDA's autocast: its fp32 list (pow, exp, the norms), fp32 results where no dtype is named (softmax, sum); the
# matmuls in the lower precision; ops on neither list (tanh) follow their input
CUDA_FP32 = ("pow", "exp", "layer_norm", "rms_norm", "softmax", "log_softmax", "sum")


@pytest.mark.parametrize("lower", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_autocast_keeps_in_the_lower_precision_what_cuda_autocast_computes_in_fp32_while_the_twin_is_entered(
    lower: torch.dtype,
) -> None:
    """Under bf16 and fp16 alike (CUDA's lists do not depend on the dtype: a T4's or V100's fp16 run saves its
    norms and GELU's pow in fp32 too)."""
    cpu = dict.fromkeys(OPS, lower)
    cuda = {**cpu, **dict.fromkeys(CUDA_FP32, torch.float32)}
    assert _dtypes(lower) == cpu  # torch's CPU policy, which a trace for a GPU must not follow
    with cuda_autocast_policy():
        assert _dtypes(lower) == cuda
    assert _dtypes(lower) == cpu  # the registrations are gone with the context


def test_under_the_twin_autograd_records_the_cast_and_gradients_keep_their_inputs_dtype() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.pow(x, 3)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, (3 * x.float() ** 2).to(torch.bfloat16))


class RecordingOp:
    """An op with a schema that records the arguments it is called with (the kernel reads only the schema)."""

    def __init__(self, schema: str) -> None:
        self._schema = torch._C.parse_schema(schema)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def test_the_fp32_result_kernel_names_fp32_where_no_dtype_is_named_and_passes_every_other_argument() -> None:
    """CUDA's fp32-result kernel fills in fp32 only where a lower-precision input names no dtype, positionally or
    by keyword as the op's schema has it, and passes the other arguments as given, those after the dtype too (no
    op of ``FP32_RESULT_OPS`` has one after a positional dtype today; ``_to_dense``'s schema does)."""
    x, x32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    positional = RecordingOp("demo(Tensor self, int dim, ScalarType? dtype=None, bool flag=False) -> Tensor")
    kernel = _fp32_result_kernel(positional)  # type: ignore[arg-type]  # the schema is all it reads of an op
    for args, passed in [((x, 1, None, True), (x, 1, torch.float32, True)), ((x, 1), (x, 1, torch.float32)),
                         ((x, 1, torch.bfloat16, True), (x, 1, torch.bfloat16, True)),
                         ((x32, 1, None, True), (x32, 1, None, True))]:
        kernel(*args)
        assert positional.calls.pop() == (passed, {})
    keyword = RecordingOp("demo(Tensor self, int dim, *, ScalarType? dtype=None) -> Tensor")
    kernel = _fp32_result_kernel(keyword)  # type: ignore[arg-type]
    kernel(x, 0)
    kernel(x, 0, dtype=torch.float16)
    assert keyword.calls == [((x, 0), {"dtype": torch.float32}), ((x, 0), {"dtype": torch.float16})]


def _gpt2_peak(device: str, precision: str = "bf16") -> tuple[float, float]:
    cfg = typed_config(compose_config([
        "model=gpt2_small", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
        "data=synthetic",
        "data.seq_len=64", "data.vocab_size=512", "data.micro_batch_size=4", "data.global_batch_size=4",
        f"plan.device={device}", f"train.precision={precision}"])).typed
    step = TracedStep(4, checkpointing(cfg), 2, 1, cfg.train.chunked_loss)
    peak = trace_peak(cfg, 512, step, target_device(device, None, None)).peak
    return peak.by_category["activations"], peak.peak


def test_a_trace_for_a_gpu_saves_gpt2s_fp32_gelu_and_layer_norms_as_cuda_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPT-2's tanh GELU starts with ``pow`` and its blocks with LayerNorm: fp32 on CUDA, so a GPU step saves
    more activations than the same step under the CPU's autocast."""
    activations, peak = _gpt2_peak("h100")
    t4_fp16, _ = _gpt2_peak("t4", "fp16")  # a T4 computes in fp16 (loss-scaled): the same lists apply
    monkeypatch.setattr(trace_module, "cuda_autocast_policy", nullcontext)  # the CPU's policy, as before
    cpu_policy_activations, cpu_policy_peak = _gpt2_peak("h100")
    assert activations > 1.3 * cpu_policy_activations and peak > cpu_policy_peak
    assert t4_fp16 == activations  # fp16 and bf16 tensors are alike in size: the same fp32 ops, the same bytes
    assert t4_fp16 > 1.3 * _gpt2_peak("t4", "fp16")[0]
