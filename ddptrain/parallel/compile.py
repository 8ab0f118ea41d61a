"""Regional compilation: ``torch.compile`` each transformer block rather than the whole model.

The blocks of a model share one code path, so Dynamo compiles it once and reuses it for every layer: compile
time stays that of one block, whatever the depth. Blocks are compiled in place before the model is wrapped,
so torch DDP and FSDP2 hook the same parameters as in eager mode; each block's graph holds only its own
parameters, which is the bucket-aware split DDP's whole-model compile would otherwise have to make.

One graph for every layer holds only if Dynamo guards on nothing that differs between layers or micro batches:

- transformers' FlashAttention-2 path reads each attention module's ``layer_idx`` (an int on an ``nn.Module``,
  which Dynamo specializes by default): one graph per layer, up to ``recompile_limit`` (8), then the later layers
  run eager. ``layer_idx`` is made a dynamic source (``torch.compiler.config.dynamic_sources``), so all layers
  share a graph.
- the same path logs through ``Logger.warning_once`` (its fp32-to-half cast of q, k and v, which rotary embeddings
  in fp32 cause under autocast); Dynamo cannot trace a logger and breaks the graph there, in every layer. That
  method is made a no-op inside compiled code (``torch._dynamo.config.ignore_logging_functions``, which torch's own
  graph-break hint names); eager code still logs it.
- prompt/completion micro batches change shape every micro batch (rows, their length, packed rows' segment
  offsets and longest segment): ``varying_shapes`` compiles for any size from the first call (``dynamic=True``)
  instead of specializing to the first micro batch's sizes and recompiling at the next. One exception torch keeps:
  a size of 1 is specialized, so a micro batch packed into one row has a graph of its own (at most two in all).

Both settings are process-wide (read while Dynamo traces, and a run compiles nothing but its blocks) and are set
only when the run compiles its blocks.
"""

from __future__ import annotations

import logging

import torch

from ddptrain.errors import ConfigError
from ddptrain.parallel.zero import transformer_blocks

LAYER_INDEX = r".*layer_idx"  # any traced source named layer_idx: a module's attribute or a keyword argument


def trace_every_layer_alike() -> None:
    """Dynamo settings under which one graph serves every layer (see the module docstring)."""
    sources = torch.compiler.config.dynamic_sources
    if LAYER_INDEX not in sources.split(","):
        torch.compiler.config.dynamic_sources = ",".join(filter(None, [sources, LAYER_INDEX]))
    warning_once = getattr(logging.Logger, "warning_once", None)  # transformers adds it to every Logger
    if warning_once is not None:
        torch._dynamo.config.ignore_logging_functions = {*torch._dynamo.config.ignore_logging_functions, warning_once}


def compile_blocks(model: torch.nn.Module, varying_shapes: bool = False) -> int:
    """Compile every transformer block in place (compilation runs at the first call); returns how many.
    ``varying_shapes``: the micro batches change shape (prompt/completion data), so compile for any size."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"train.compile=true: {type(model).__name__} lists no transformer block classes "
                          "(_no_split_modules) to compile")
    trace_every_layer_alike()
    for block in blocks:
        block.compile(dynamic=True if varying_shapes else None)
    return len(blocks)
