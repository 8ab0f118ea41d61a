"""Per-rank micro batches from one global sample order (resumable on any world size), and the validation loader."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ddptrain.data.batch import BatchShape
from ddptrain.data.packing import REAL_TOKENS, SEGMENT_SQUARES, to_device
from ddptrain.errors import ConfigError

if TYPE_CHECKING:  # imported where it is used: a synthetic run never loads ``datasets``
    from datasets import Dataset as ArrowDataset

log = logging.getLogger(__name__)


class GlobalOrderSampler(Sampler[int]):
    """This rank's share of one global sample order that does not depend on the world size.

    Epoch ``e`` visits a permutation seeded by ``seed + e`` (DistributedSampler's), cut to ``epoch_len``; the
    data position is a global cursor into it and rank ``r`` takes every ``dp``-th index from ``cursor + r`` on.
    One micro-step of all ranks consumes ``micro_batch x dp`` consecutive positions, one optimizer step
    ``global_batch`` of them: the samples of each step are the same on any world size.
    """

    def __init__(self, size: int, epoch_len: int, dp: int, rank: int, shuffle: bool, seed: int) -> None:
        self.size, self.epoch_len, self.dp, self.rank = size, epoch_len, dp, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.cursor = 0  # global position in this epoch's order where iteration starts

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.epoch_len))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()[: self.epoch_len]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch)[self.cursor + self.rank :: self.dp])

    def __len__(self) -> int:
        return len(range(self.cursor + self.rank, self.epoch_len, self.dp))


class TokenCount:
    """Real (non-padding) tokens, computed positions and the sum of squared sequence lengths (each packed example a
    sequence of its own) of the micro batches seen, counted on the host from the CPU batch before it moves to the
    device: no sync. The squares are what attention's FLOPs grow with."""

    def __init__(self) -> None:
        self.real = self.computed = self.squares = 0

    def count(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Adds ``batch``'s tokens; returns the model's inputs (a packed batch's own counts removed)."""
        ids = batch["input_ids"]
        self.computed += ids.numel()
        if REAL_TOKENS in batch:  # packed prompt/completion rows
            batch = dict(batch)
            self.real += int(batch.pop(REAL_TOKENS))
            self.squares += int(batch.pop(SEGMENT_SQUARES))
        elif "attention_mask" in batch:  # padded prompt/completion rows: one example per row
            lengths = batch["attention_mask"].sum(dim=1)
            self.real += int(lengths.sum())
            self.squares += int((lengths * lengths).sum())
        else:  # fixed blocks of seq_len tokens: no padding
            self.real += ids.numel()
            self.squares += ids.numel() * ids.shape[-1]
        return batch

    def take(self) -> tuple[int, int, int]:
        """(real, computed, squares) since the last take."""
        out = (self.real, self.computed, self.squares)
        self.real = self.computed = self.squares = 0
        return out


class SampleOrder(NamedTuple):
    """The order samples are drawn in: shuffled by ``seed`` each epoch (``data.shuffle``), or as stored."""

    seed: int
    shuffle: bool


class MicroBatches:
    """An endless stream of this rank's micro batches over epochs, resumable at a global data position.

    An epoch is cut to whole global batches, so no optimizer step straddles two epochs and the epoch, like the
    position, means the same on every world size.
    """

    def __init__(
        self, dataset: Dataset, shape: BatchShape, rank: int, order: SampleOrder, num_workers: int,
        device: torch.device, collate: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    ) -> None:
        seed, shuffle = order.seed, order.shuffle
        self.epoch_len = len(dataset) // shape.global_batch_size * shape.global_batch_size
        if self.epoch_len == 0:
            raise ConfigError(
                f"data: {len(dataset)} training sequences of {shape.seq_len} tokens cannot fill one global batch of "
                f"data.global_batch_size={shape.global_batch_size}"
            )
        self.per_micro_step = shape.micro_batch_size * shape.dp
        self.sampler = GlobalOrderSampler(len(dataset), self.epoch_len, shape.dp, rank, shuffle, seed)
        self.loader = DataLoader(
            dataset, batch_size=shape.micro_batch_size, sampler=self.sampler, drop_last=True,
            num_workers=num_workers, pin_memory=device.type == "cuda", generator=_own_generator(seed),
            collate_fn=collate,
        )
        self.device = device
        self.epoch = 0
        self.position = 0  # global samples of this epoch consumed by all ranks together: the data position
        self.tokens = TokenCount()  # this rank's real and computed token positions since the last take()
        self._it: Iterator[dict[str, torch.Tensor]] | None = None
        self._seq_len = shape.seq_len
        # prompt/completion rows (a collate) vary in length; fixed blocks hold seq_len real tokens each
        self._lengths: torch.Tensor | None = None if collate is None else real_lengths(dataset)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order): the last one summed over
        self._tokens_offset = 0  # tokens_seen = offset + the real tokens of this epoch before the position

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> torch.Tensor | dict[str, torch.Tensor]:
        if self._it is None:
            self.sampler.epoch, self.sampler.cursor = self.epoch, self.position
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self._tokens_offset = self.tokens_seen
            self.epoch, self.position, self._it = self.epoch + 1, 0, None
            return next(self)
        except ConfigError as exc:  # a damaged shard, found by a DataLoader worker
            # The error's traceback holds the loader's iterator in its frames, which hold the error: left to the
            # garbage collector, the iterator's shutdown waited 5 s (torch's join timeout) for a worker whose queue
            # the collector had closed first. Without that cycle the iterator ends here, its workers at once.
            exc.__traceback__ = None
            self._it = None
            raise worker_error(exc) from None
        self.position += self.per_micro_step
        batch = self.tokens.count(batch)
        if len(batch) == 1:  # packed blocks: the token ids are inputs and labels alike
            return batch["input_ids"].to(self.device, non_blocking=True)
        return to_device(batch, self.device, non_blocking=True)

    @property
    def tokens_seen(self) -> int:
        """Real tokens of every sample before the data position, all ranks together: what the run has trained on.
        Known on every rank without a collective: the global sample order and each sample's length are."""
        return self._tokens_offset + self._tokens_of(self.epoch, self.position)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at a position saved on any world size. It always starts a micro-step here unless the global
        batch changed; then the samples it cannot continue from exactly are counted in a warning.

        The token count continues from the checkpoint's ``tokens_seen``; one saved before the count was recorded
        gets the count its data position implies (exact unless the global batch, hence the epoch's length,
        changed in an earlier epoch)."""
        epoch, position = state["epoch"], state["position"]
        seen = state.get("tokens_seen")
        if seen is None:
            seen = sum(self._tokens_of(e, self.epoch_len) for e in range(epoch))
            seen += self._tokens_of(epoch, min(position, self.epoch_len))
            log.info("the checkpoint records no token count (an earlier version's): tokens_seen continues from %d, "
                     "the real tokens before its data position", seen)
        if position >= self.epoch_len:
            if position > self.epoch_len:
                log.warning("data position %d is past the end of epoch %d here (%d samples with this global batch): "
                            "continuing with epoch %d", position, epoch, self.epoch_len, epoch + 1)
            epoch, position = epoch + 1, 0
        elif excess := position % self.per_micro_step:
            log.warning("data position %d is not a multiple of %d sequences per micro-step: the last %d samples "
                        "before it are seen again", position, self.per_micro_step, excess)
            position -= excess
        self.epoch, self.position, self._it = epoch, position, None
        self._tokens_offset = seen - self._tokens_of(epoch, position)  # samples seen again count again

    def _tokens_of(self, epoch: int, count: int) -> int:
        """Real tokens of the first ``count`` samples of ``epoch``'s global order."""
        if self._lengths is None:
            return count * self._seq_len
        if count == 0:
            return 0
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, torch.as_tensor(self.sampler.order(epoch), dtype=torch.long))
        return int(self._lengths[self._order[1][:count]].sum())


def real_lengths(dataset: ArrowDataset) -> torch.Tensor:
    """Each prompt/completion row's length (its real tokens), read from the Arrow column without decoding rows."""
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    return torch.from_numpy(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype("int64"))


def eval_batches(
    dataset: Dataset, micro_batch_size: int, dp: int, rank: int, limit: int,
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
) -> list[torch.Tensor | dict[str, torch.Tensor]]:
    """The same fixed validation batches at every evaluation (at most ``limit`` per rank)."""
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=False, drop_last=True)
    batch_size = max(1, min(micro_batch_size, sampler.num_samples))
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, generator=_own_generator(0),
                        collate_fn=collate)
    out: list[torch.Tensor | dict[str, torch.Tensor]] = []
    for batch in loader:
        if len(out) == limit:
            break
        batch = TokenCount().count(batch)
        out.append(batch["input_ids"] if len(batch) == 1 else batch)
    return out


def worker_error(exc: ConfigError) -> ConfigError:
    """A ``ConfigError`` raised in a DataLoader worker process reaches this one as torch's text ("Caught
    ConfigError in DataLoader worker process 0", the worker's traceback): keep its own one line."""
    last = str(exc).rstrip().splitlines()[-1]
    return ConfigError(last.split("ConfigError: ", 1)[-1])


def _own_generator(seed: int) -> torch.Generator:
    """A DataLoader's own generator. Without one, every new iterator (at the start, at each epoch, after a
    resume) draws its workers' base seed from torch's global generator, which then no longer continues the
    stream a checkpoint saved: dropout masks after a resume would differ from the uninterrupted run's."""
    return torch.Generator().manual_seed(seed)
