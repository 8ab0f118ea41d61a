"""Regional compilation: ``torch.compile`` each transformer block rather than the whole model.

The blocks of a model share one code path, so Dynamo compiles it once and reuses it for every layer: compile
time stays that of one block, whatever the depth. Blocks are compiled in place before the model is wrapped,
so torch DDP and FSDP2 hook the same parameters as in eager mode; each block's graph holds only its own
parameters, which is the bucket-aware split DDP's whole-model compile would otherwise have to make.
"""

from __future__ import annotations

import torch

from ddptrain.errors import ConfigError
from ddptrain.parallel.zero import transformer_blocks


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every transformer block in place (compilation runs at the first call); returns how many."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(f"train.compile=true: {type(model).__name__} lists no transformer block classes "
                          "(_no_split_modules) to compile")
    for block in blocks:
        block.compile()
    return len(blocks)

