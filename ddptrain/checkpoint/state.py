"""The one logical layout of model and optimizer state, keyed by parameter name, for every strategy.

``{"model": {name: tensor}, "optim": {"state.<name>.<key>": tensor, "param_groups.<name>.<key>": value}}`` is
torch.distributed.checkpoint's flattened optimizer form: every entry belongs to one parameter name, so a
checkpoint written by any strategy on any world size loads into any other (DCP reads whatever slice each rank
needs). Plain modules (torch DDP, our engines) and FSDP2 (ZeRO-2/3) go through torch's ``get/set_*_state_dict``;
ZeroRedundancyOptimizer (ZeRO-1) has its own mapping below, as torch's helpers do not know its shards.
Frozen parameters (adapters' base weights) are in ``model`` and have no optimizer entry.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ddptrain.checkpoint.safe import SafeReader
from ddptrain.optim import local_optimizer

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
State = dict[str, dict[str, Any]]


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ZeRO-1's ZeroRedundancyOptimizer. Looked up in ``sys.modules``: an optimizer can only
    be one once torch.distributed.optim is imported (``ddptrain.optim`` imports it for stage 1 alone), and that
    import compiles torch's functional optimizers with TorchScript: 0.2 s of every other run's workers' start-up."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> State:
    """This rank's part of the name-keyed state, ready for ``dcp.save`` (tensors are the live ones, not copies)."""
    if is_zero1(optimizer):
        return {"model": get_model_state_dict(model), "optim": _zero1_optimizer_state(model, optimizer)}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)}


def load_named_state(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fill ``model`` and ``optimizer`` from a name-keyed DCP directory written under any strategy and world size."""
    if is_zero1(optimizer):
        _load_zero1(checkpoint, model, optimizer)
        return
    wanted = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)}
    dcp.load(wanted, storage_reader=SafeReader(str(checkpoint)))
    set_model_state_dict(model, wanted["model"])
    set_optimizer_state_dict(model, optimizer, wanted["optim"], options=FLAT)


def _names(model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    # named_parameters() yields a tied parameter once, under its first name: the name torch's helpers use too.
    return {p: n for n, p in model.named_parameters()}


def _zero1_optimizer_state(model: torch.nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """ZeRO-1: the flattened entries of the parameters this rank's shard owns (other ranks write theirs)."""
    names, owned, flat = _names(model), local_optimizer(optimizer).state, {}
    for group in optimizer.param_groups:  # the global groups: hyperparameters (lr, betas, ...) of every parameter
        for p in group["params"]:
            if p in owned:
                flat.update({f"state.{names[p]}.{k}": v for k, v in owned[p].items()})
                flat.update({f"param_groups.{names[p]}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def _load_zero1(checkpoint: Path, model: torch.nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
    """Read the parameters' weights, the state of the parameters this rank owns now (whichever rank or strategy
    wrote it) and each global group's hyperparameters (from its first parameter's entries)."""
    names, local = _names(model), local_optimizer(optimizer)
    owned = [p for group in local.param_groups for p in group["params"]]
    flat: dict[str, Any] = {}
    for group in local.param_groups:
        # Fused and capturable AdamW keep ``step`` on the parameter's device; the others on the CPU.
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            flat.update({f"state.{names[p]}.{k}": v for k, v in _adamw_state_like(p, on_device).items()})
    for group in optimizer.param_groups:
        if group["params"]:
            first = names[group["params"][0]]
            flat.update({f"param_groups.{first}.{k}": v for k, v in group.items() if k != "params"})
    wanted = {"model": get_model_state_dict(model), "optim": flat}
    dcp.load(wanted, storage_reader=SafeReader(str(checkpoint)))
    set_model_state_dict(model, wanted["model"])
    for p in owned:
        prefix = f"state.{names[p]}."
        local.state[p] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
    for group in optimizer.param_groups:
        if group["params"]:
            prefix = f"param_groups.{names[group['params'][0]]}."
            group.update({k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)})


def _adamw_state_like(param: torch.Tensor, step_on_device: bool) -> dict[str, torch.Tensor]:
    """The entries AdamW keeps per parameter (build_optimizer always builds AdamW), to be filled by ``dcp.load``."""
    step_device = param.device if step_on_device else torch.device("cpu")
    return {"step": torch.zeros((), dtype=torch.float32, device=step_device), "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param)}
