"""torch DDP through our loop gives exactly the single-process gradients and loss curve for the same global batch."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from ddptrain.config.schema import Config, ModelConfig, ParallelConfig
from ddptrain.models import build_model
from ddptrain.parallel import wrap_model
from ddptrain.step.compute import accumulate_gradients
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import TINY_MODEL

VOCAB, SEQ, B = 256, 16, 4  # B sequences per rank


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(**TINY_MODEL, max_position_embeddings=64)
    return build_model(cfg, VOCAB, eos_id=0)


def _global_batch(world_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (world_size * B, SEQ), generator=torch.Generator().manual_seed(7))


def _reference_grads(world_size: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch in one forward/backward."""
    model = _tiny_model()
    ids = _global_batch(world_size)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ddp_grads(rank: int, world_size: int, grad_accum: int) -> dict:
    model = _tiny_model(seed=rank)  # a different init on each rank: DDP's broadcast from rank 0 must fix it
    wrapped = wrap_model(model, ParallelConfig(), torch.device("cpu"))
    shard = _global_batch(world_size)[rank * B : (rank + 1) * B]
    micro = iter(shard.chunk(grad_accum))
    seen_after_first: dict[str, torch.Tensor] = {}

    def maybe_sync(sync: bool):
        if not sync and not seen_after_first:
            return _RecordAfter(wrapped.maybe_sync(False), model, seen_after_first)
        return wrapped.maybe_sync(sync)

    accumulate_gradients(wrapped.outer, micro, grad_accum, maybe_sync, nullcontext())
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "local_after_first_micro": {n: g.clone() for n, g in seen_after_first.items()},
    }


class _RecordAfter:
    """Wraps no_sync() and records the gradients as they stand when it exits (local, not yet averaged)."""

    def __init__(self, inner, model: torch.nn.Module, out: dict) -> None:
        self.inner, self.model, self.out = inner, model, out

    def __enter__(self) -> None:
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        self.out.update({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ddp_gradients_equal_single_process_on_concatenated_batch(grad_accum: int) -> None:
    world_size = 2
    reference = _reference_grads(world_size)
    results = run_distributed(_ddp_grads, world_size, grad_accum)
    for rank, result in enumerate(results):
        for name, ref in reference.items():
            torch.testing.assert_close(result["grads"][name], ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    if grad_accum > 1:  # under no_sync the first micro-step's gradients stay local: the ranks disagree
        a, b = (r["local_after_first_micro"] for r in results)
        assert any(not torch.equal(a[n], b[n]) for n in a)


def _train_losses(rank: int, world_size: int, grad_accum: int, cache_dir: str, run_dir: str) -> list[float]:
    from omegaconf import OmegaConf

    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import train
    from tests.helpers.runs import without_the_planned_peak

    without_the_planned_peak()  # the summary's traced memory plan: half of each run's CPU, no part of its losses
    cfg = OmegaConf.structured(Config)
    cfg.model.hidden_size, cfg.model.num_layers = 64, 2
    # a 1,024-token BPE (the default trains 8,192 on these 40 documents) and no export of the trained model: the
    # run's cost is its steps, which the sampler's split is about
    cfg.data.update(max_documents=40, vocab_size=1024, seq_len=64, global_batch_size=8, micro_batch_size=2,
                    grad_accum=grad_accum, cache_dir=cache_dir)
    cfg.train.update(steps=6, log_every=1, eval_every=0)
    cfg.logger.progress = False
    cfg.checkpoint.export = False
    typed = OmegaConf.to_object(cfg)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    train(typed, env, torch.device("cpu"), Path(run_dir), {})
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_two_ranks_with_half_the_accumulation_track_one_rank(tmp_path: Path) -> None:
    """Same global batch (8 = 2 x 4 x 1 = 2 x 2 x 2): DistributedSampler hands the two ranks exactly the
    sequences one rank would see in each step, so the curves agree up to float summation order."""
    cache = str(tmp_path / "cache")
    one = run_distributed(_train_losses, 1, 4, cache, str(tmp_path / "one"))[0]
    two = run_distributed(_train_losses, 2, 2, cache, str(tmp_path / "two"))[0]
    assert len(one) == len(two) == 6
    assert one[-1] < one[0]
    for step, (a, b) in enumerate(zip(one, two, strict=True), 1):
        assert abs(a - b) < 1e-3 * abs(a), f"step {step}: 1 rank {a:.6f} vs 2 ranks {b:.6f}"
