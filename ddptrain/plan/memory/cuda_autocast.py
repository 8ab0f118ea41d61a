"""CUDA's autocast policy on the CPU, for a traced step that plans a GPU run.

A trace runs on CPU tensors under ``torch.autocast("cpu")``, whose op lists are not CUDA's: CUDA's autocast runs
the ops below in fp32 (``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE`` in ATen's ``autocast_mode.h``),
where the CPU's runs most of them in the lower precision. The dtypes decide the bytes a step saves for
backward: GPT-2's tanh GELU (``pow``, then a chain in fp32) and its LayerNorms save fp32 tensors on CUDA and
bf16 ones on the CPU, ~40 % of a bf16 GPT-2 step's activations (measured on an H100: a CPU-autocast plan of
gpt2_small at micro batch 64 fell 28 % short of ``torch.cuda.max_memory_allocated``).

``cuda_autocast_policy()`` registers, for as long as it is entered, an ``AutocastCPU`` kernel for each of those
ops that does what CUDA's autocast kernel does: cast floating lower-precision inputs to fp32 (``fp32``), or
ask for an fp32 result where the call names no dtype (``fp32_set_opt_dtype``), then run the op with autocast
off (autograd records the cast, as on CUDA). On exit the registrations are dropped and the CPU's own policy
is back. Ops that CUDA runs in the lower precision (``mm``, ``linear``, ``bmm``, attention, ...) are in the
CPU's lower-precision list too; the widest-type list (``cat``, ``stack``, ``addcmul``, ...) follows type
promotion on both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# CUDA's fp32 list (ATen autocast_mode.h, AT_FORALL_FP32): the inputs are cast to fp32
FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
)
# CUDA's fp32-result list (AT_FORALL_FP32_SET_OPT_DTYPE): a call that names no dtype gets an fp32 result
FP32_RESULT_OPS = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
LOWER = (torch.bfloat16, torch.float16)


def _overload(name: str) -> torch._ops.OpOverload:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOWER else value
    if isinstance(value, list | tuple):
        return type(value)(_to_fp32(v) for v in value)
    return value


def _fp32_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False):
            return op(*_to_fp32(args), **_to_fp32(kwargs))
    return kernel


def _fp32_result_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    schema = op._schema
    position = next(i for i, a in enumerate(schema.arguments) if a.name == "dtype")
    keyword = schema.arguments[position].kwarg_only

    def kernel(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        named = kwargs.get("dtype") if keyword else (args[position] if len(args) > position else None)
        if isinstance(first, torch.Tensor) and first.dtype in LOWER and named is None:
            if keyword:
                kwargs = {**kwargs, "dtype": torch.float32}
            else:
                args = (*args[:position], *(None,) * (position - len(args)), torch.float32, *args[position + 1:])
        with torch.autocast("cpu", enabled=False):
            return op(*args, **kwargs)
    return kernel


@contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """``torch.autocast("cpu")`` computes in the dtypes CUDA's autocast would, while entered."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # the CPU registers a few of these itself (fp32 there too): replaced alike
        warnings.simplefilter("ignore", UserWarning)
        for name in FP32_OPS:
            library.impl(name, _fp32_kernel(_overload(name)), "AutocastCPU")
        for name in FP32_RESULT_OPS:
            library.impl(name, _fp32_result_kernel(_overload(name)), "AutocastCPU")
    try:
        yield
    finally:
        del library  # its finalizer drops every registration: the CPU's own policy again
