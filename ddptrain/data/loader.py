"""Per-rank micro batches: a resumable DistributedSampler over epochs, and the validation loader."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from datasets import Dataset
from torch.utils.data import DataLoader, DistributedSampler

from ddptrain.data.batch import BatchPlan
from ddptrain.errors import ConfigError


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch (the data position of a checkpoint)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


class MicroBatches:
    """An endless stream of this rank's micro batches; calls ``set_epoch`` at every epoch boundary."""

    def __init__(
        self, dataset: Dataset, plan: BatchPlan, rank: int, seed: int, shuffle: bool, num_workers: int,
        device: torch.device,
    ) -> None:
        per_rank = len(dataset) // plan.dp
        if per_rank < plan.micro_batch_size:
            raise ConfigError(
                f"data: {len(dataset)} training sequences of {plan.seq_len} tokens cannot fill one micro batch of "
                f"data.micro_batch_size={plan.micro_batch_size} on each of {plan.dp} ranks"
            )
        self.sampler = ResumableSampler(dataset, plan.dp, rank, shuffle, seed)
        self.loader = DataLoader(
            dataset, batch_size=plan.micro_batch_size, sampler=self.sampler, drop_last=True,
            num_workers=num_workers, pin_memory=device.type == "cuda", generator=_own_generator(seed),
        )
        self.device = device
        self.epoch = 0
        self.batches_in_epoch = 0  # consumed in the current epoch: the data position
        self._it: Iterator[dict[str, torch.Tensor]] | None = None

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> torch.Tensor:
        if self._it is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.batches_in_epoch * self.loader.batch_size  # type: ignore[operator]
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.batches_in_epoch, self._it = self.epoch + 1, 0, None
            return next(self)
        self.batches_in_epoch += 1
        return batch["input_ids"].to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches_in_epoch, self._it = state["epoch"], state["batches_in_epoch"], None


def eval_batches(dataset: Dataset, micro_batch_size: int, dp: int, rank: int, limit: int) -> list[torch.Tensor]:
    """The same fixed validation batches at every evaluation (at most ``limit`` per rank)."""
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=False, drop_last=True)
    batch_size = max(1, min(micro_batch_size, sampler.num_samples))
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, generator=_own_generator(0))
    out = []
    for batch in loader:
        if len(out) == limit:
            break
        out.append(batch["input_ids"])
    return out


def _own_generator(seed: int) -> torch.Generator:
    """A DataLoader's own generator. Without one, every new iterator (at the start, at each epoch, after a
    resume) draws its workers' base seed from torch's global generator, which then no longer continues the
    stream a checkpoint saved: dropout masks after a resume would differ from the uninterrupted run's."""
    return torch.Generator().manual_seed(seed)
