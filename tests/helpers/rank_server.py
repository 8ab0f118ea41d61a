"""What the rank fork server of ``tests/helpers/dist.py`` preloads, imported with the garbage collector off and
then settled (``tests/helpers/collector.py``): every forked rank starts with these modules loaded and frozen.

The modules are what the ranks of almost every test import; one missing here is imported by each rank that needs
it (the trainer by its module: ``ddptrain.train`` itself is a light package and preloads nothing of it). pytest: a
rank imports the test module that defines its function, which imports pytest (0.12 CPU s a rank); the Llama model:
transformers loads it lazily, at a rank's first ``build_model`` (0.1 CPU s a rank); ``torch.distributed.optim``:
ZeRO-1's optimizer, which a worker imports only for ZeRO-1 (its functional optimizers are TorchScript, compiled at
import: 0.3-0.4 CPU s in every rank that trains or loads a ZeRO-1 run).
"""

from __future__ import annotations

from importlib import import_module

from ddptrain.runtime.imports import imports_without_the_collector
from tests.helpers import collector

MODULES = ["torch", "torch.distributed", "transformers", "datasets", "ddptrain.train.trainer", "tests.helpers.runs",
           "pytest", "transformers.models.llama.modeling_llama", "torch.distributed.optim"]

with imports_without_the_collector():
    for _name in MODULES:
        import_module(_name)
collector.settle()
