"""``PeakTracker`` under a fake mode: what a fake tensor answers to a device query from C++ (``prim.device``, which
the autograd engine and the optimizers' grouping by device ask of every tensor) is its own device, index included,
with the tracker on as without it."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ddptrain.telemetry.storage_peak import PeakTracker


def _grouped_devices(tensors: list[torch.Tensor]) -> list[str]:
    """The devices ``_group_tensors_by_device_and_dtype`` (foreach/fused optimizers, clipping) sorts ``tensors`` by."""
    return sorted(str(device) for device, _ in torch._C._group_tensors_by_device_and_dtype([tensors], False))


def test_a_fake_tensors_device_query_under_the_tracker_answers_its_own_device() -> None:
    with FakeTensorMode():
        on_card, on_host = torch.empty(4, device="cuda:0"), torch.empty(4, device="cpu")
        bare = _grouped_devices([on_card, on_host])
        with PeakTracker() as tracker:
            card, host = torch.empty(4, device="cuda:0"), torch.empty(4, device="cpu")
            tracked = _grouped_devices([card, host])
    assert tracker.peak.peak == 32  # the tracker was on: it counted both new tensors
    assert bare == ["cpu", "cuda:0"]
    assert tracked == bare, f"under PeakTracker a fake tensor's device query answers {tracked}, not {bare}"
