"""The tiny model, data and inner step the DiLoCo checks train (tests/test_diloco.py, and the worker processes of
tests/helpers/ft_diloco_worker.py): the same in a thread and in a process, so their results compare bit for bit."""

from __future__ import annotations

import torch
from torch import nn

INNER_LR = 1e-2


class Net(nn.Module):
    """A tiny residual MLP with four "blocks" (an nn.ModuleList, as a transformer's layers are)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def _seeded(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Net().state_dict()


# made once, at import: groups may run as threads, and torch's global generator is not theirs to seed
INIT, TEACHER = _seeded(0), Net()
TEACHER.load_state_dict(_seeded(123))


def fresh_net() -> Net:
    """The model every group starts from (the same weights: groups start in agreement, as seeded DDP ranks do)."""
    net = Net()
    net.load_state_dict(INIT)
    return net


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s batch at inner step ``step``: its own data (a fixed teacher's targets)."""
    gen = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(16, 6, generator=gen)
    with torch.no_grad():
        y = TEACHER(x) * 3
    return x, y


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, group: int, step: int) -> float:
    """One inner step on the group's batch; its loss."""
    x, y = batch(group, step)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
