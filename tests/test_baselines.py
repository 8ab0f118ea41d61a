"""Honest baselines: world size 1 trains the bare model; each rank draws its own dropout masks after an
identical initialisation, and a resumed run with dropout continues each rank's stream exactly."""

from __future__ import annotations

import importlib.util
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config.schema import ModelConfig, ParallelConfig
from ddptrain.models import build_model
from ddptrain.parallel import wrap_model
from ddptrain.step.compute import accumulate_gradients
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train_each
from tests.helpers.tiny import TINY_MODEL

COMM_KEYS = ("comm_bytes", "comm_time_s", "time_exposed_comm_s", "overlap_pct", "algbw_gbps", "busbw_gbps")
TINY = ModelConfig(**TINY_MODEL, max_position_embeddings=64)
VOCAB = 256
BASE = {
    "model": TINY_MODEL,
    "data": {"source": "synthetic", "vocab_size": VOCAB, "num_samples": 128, "seq_len": 32, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 2, "eval_every": 0},
}


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(3))


def _accumulated_grads(rank: int, world_size: int) -> dict[str, Any]:
    """At one rank: the bare model's and the wrapped model's gradients over two micro-batches."""
    out: dict[str, Any] = {}
    for wrap_single in (False, True):
        torch.manual_seed(0)
        model = build_model(TINY, VOCAB, eos_id=0)
        wrapped = wrap_model(model, ParallelConfig(wrap_single=wrap_single), torch.device("cpu"))
        accumulate_gradients(wrapped.outer, iter(_batch().chunk(2)), 2, wrapped.maybe_sync, nullcontext())
        out[str(wrap_single)] = {"module": type(wrapped.outer).__name__, "bare": wrapped.outer is model,
                                 "strategy": wrapped.strategy,
                                 "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def test_one_rank_accumulates_on_the_bare_model_with_the_single_batch_gradients() -> None:
    torch.manual_seed(0)
    reference = build_model(TINY, VOCAB, eos_id=0)
    ids = _batch()
    reference(input_ids=ids, labels=ids).loss.backward()
    (result,) = run_distributed(_accumulated_grads, 1)
    bare, wrapped = result["False"], result["True"]
    assert bare["bare"] and bare["strategy"] == "none"
    assert wrapped["module"] == DistributedDataParallel.__name__ and wrapped["strategy"] == "torch DDP"
    for run in (bare, wrapped):  # no no_sync at N=1 and no wrapper: the same mean gradient
        for name, param in reference.named_parameters():
            torch.testing.assert_close(run["grads"][name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def _train_logging(rank: int, world_size: int, tmp: str, base: dict, variants: list[dict]) -> dict[str, Any]:
    """``train_each``, plus the ddptrain log records of this rank."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ddptrain")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return {"runs": train_each(rank, world_size, tmp, base, variants), "log": records}


def _load_scaling() -> Any:
    path = Path(__file__).parents[1] / "scripts" / "scaling.py"
    spec = importlib.util.spec_from_file_location("scaling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_world_size_one_logs_no_communication_unless_wrapped_and_the_sweep_row_shows_none(tmp_path: Path) -> None:
    peak = {"metrics": {"peak_tflops": 1.0}}
    (out,) = run_distributed(_train_logging, 1, str(tmp_path), {**BASE, **peak},
                             [{}, {"parallel": {"wrap_single": True}}])
    bare, wrapped = out["runs"]
    assert bare["summary"]["wrapper"] == "none" and wrapped["summary"]["wrapper"] == "torch DDP"
    for record in bare["metrics"]:
        assert not [k for k in COMM_KEYS if k in record], record  # absent, not zero
    for record in wrapped["metrics"][1:]:  # the first window holds DDP's bucket rebuild, comm keys still there
        assert all(k in record for k in COMM_KEYS[:3]), record
    assert any("data parallel: none (world size 1: the bare model" in m for m in out["log"])
    assert "data parallel: torch DDP" in out["log"]

    scaling = _load_scaling()
    rows = scaling.tabulate({1: [bare["summary"]]})
    assert not [k for k in COMM_KEYS if k in rows[0]]
    assert "mfu_pct" in scaling.columns(rows) and "MFU %" in scaling.markdown_table(rows)
    wrapped_rows = scaling.tabulate({1: [wrapped["summary"]]})
    assert "time_exposed_comm_s" in scaling.columns(wrapped_rows)


def _first_steps(rank: int, world_size: int, tmp: str) -> dict[float, dict[str, Any]]:
    """Per dropout rate: one real training step in which both ranks are fed the same batch; the initial weights
    (before DDP's broadcast) and this rank's loss."""
    from ddptrain.train import trainer
    from tests.helpers.runs import without_the_planned_peak
    from tests.helpers.trainers import train_each_with

    without_the_planned_peak()  # as train_each: the summary's traced memory plan is no part of these checks
    seen: dict[str, Any] = {}
    real_wrap = trainer.wrap_model

    def wrap(model: torch.nn.Module, *args: Any) -> Any:
        seen["init"] = {k: v.clone() for k, v in model.state_dict().items()}
        return real_wrap(model, *args)

    class SameBatch(trainer.Trainer):
        """Every rank's step on the same batch (``_batch``), its loss kept."""

        def forward_backward_step(self, step: int, micro_batches: Any) -> torch.Tensor:
            loss = super().forward_backward_step(step, iter(_batch().chunk(self.shape.grad_accum)))
            seen["loss"] = loss.item()
            return loss

    trainer.wrap_model = wrap  # type: ignore[assignment]  # this forked rank only
    out = {}
    for dropout in (0.0, 0.1):
        variant = {"model": {"dropout": dropout}, "train": {"steps": 1, "log_every": 1}}
        train_each_with(SameBatch, rank, world_size, str(Path(tmp) / str(dropout)), BASE, [variant])
        out[dropout] = dict(seen)
    return out


def test_ranks_draw_their_own_dropout_masks_from_identical_weights(tmp_path: Path) -> None:
    first, second = run_distributed(_first_steps, 2, str(tmp_path))
    for dropout in (0.0, 0.1):
        a, b = first[dropout], second[dropout]
        assert a["init"].keys() == b["init"].keys()
        assert all(torch.equal(a["init"][k], b["init"][k]) for k in a["init"]), dropout
    assert first[0.1]["loss"] != second[0.1]["loss"]  # same weights, same batch: only the masks differ
    assert first[0.0]["loss"] == second[0.0]["loss"]  # without dropout nothing else tells the ranks apart


def test_resume_with_dropout_is_bitwise_equal_to_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = tmp_path / "w2-run0"  # train_each's directory for the first variant
    resumed_from = str(uninterrupted / "checkpoints" / "step_000002")
    dropout = {"model": {"dropout": 0.1}, "checkpoint": {"every_n_steps": 2, "export": True}}
    variants = [dropout, {**dropout, "train": {"resume": resumed_from}}]
    runs = run_distributed(train_each, 2, str(tmp_path), BASE, variants)[0]
    assert [m["loss"] for m in runs[0]["metrics"]][1:] == [m["loss"] for m in runs[1]["metrics"]]
    a, b = (load_file(Path(run["dir"]) / "model" / "model.safetensors") for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bare_one_rank_zero3_checkpoint_resumes_sharded_on_two_ranks(tmp_path: Path) -> None:
    zero3 = {"parallel": {"zero_stage": 3}, "checkpoint": {"every_n_steps": 2}}
    (one,) = run_distributed(train_each, 1, str(tmp_path), BASE, [zero3])[0]
    assert one["summary"]["wrapper"] == "none"
    resume = {"train": {"resume": str(Path(one["dir"]) / "checkpoints" / "step_000002")}}
    (two,) = run_distributed(train_each, 2, str(tmp_path), BASE, [{**zero3, **resume}])[0]
    assert two["summary"]["wrapper"] == "FSDP2 (ZeRO-3)"
    # the same global batches from the same state: steps 3-4 match the uninterrupted run up to reduction order
    assert two["metrics"][-1]["loss"] == pytest.approx(one["metrics"][-1]["loss"], rel=1e-4)
