"""Batch arithmetic: global batch = micro batch x gradient accumulation x data-parallel size."""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.config.schema import AUTO, Config
from ddptrain.errors import ConfigError


@dataclass(frozen=True)
class BatchShape:
    global_batch_size: int
    micro_batch_size: int
    grad_accum: int
    dp: int
    seq_len: int

    @classmethod
    def from_config(cls, cfg: Config, dp: int) -> BatchShape:
        """The run's batch shape at data-parallel size ``dp``: the one derivation every caller uses."""
        data = cfg.data
        if data.micro_batch_size == AUTO:  # a programming error: auto is resolved (to an int) before any shape
            raise TypeError("data.micro_batch_size=auto is chosen before the batch shape is derived")
        return cls.derive(data.global_batch_size, data.micro_batch_size, data.grad_accum, dp, data.seq_len)

    @classmethod
    def derive(cls, global_batch_size: int, micro_batch_size: int, grad_accum: int | None, dp: int, seq_len: int):
        """Check the three numbers agree (deriving grad_accum when it is None); each is positive (the schema)."""
        per_step = micro_batch_size * dp
        if grad_accum is None:
            if global_batch_size % per_step:
                raise ConfigError(
                    f"data.global_batch_size={global_batch_size} is not divisible by "
                    f"data.micro_batch_size={micro_batch_size} x dp={dp} = {per_step}"
                )
            grad_accum = global_batch_size // per_step
        elif per_step * grad_accum != global_batch_size:
            raise ConfigError(
                f"data.global_batch_size={global_batch_size} != data.micro_batch_size={micro_batch_size} x "
                f"data.grad_accum={grad_accum} x dp={dp} = {per_step * grad_accum}"
            )
        return cls(global_batch_size, micro_batch_size, grad_accum, dp, seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def equation(self) -> str:
        return (
            f"global batch {self.global_batch_size} = micro batch {self.micro_batch_size} x grad accum "
            f"{self.grad_accum} x dp {self.dp}  ({self.tokens_per_step:,} tokens/step at seq_len {self.seq_len})"
        )
