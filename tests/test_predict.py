"""The what-if predictor: α–β all-reduce over node layouts, per-bucket overlap, the link fit, calibration, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddptrain.comm.linkfit import fit_link
from ddptrain.errors import ConfigError
from ddptrain.plan import Link
from ddptrain.predict import Calibration, Layout, allreduce_seconds, exposed_comm, predict
from tests.cli import run_cli
from tests.dist import run_distributed
from tests.runs import train_each

NVLINK = Link("nvlink", 100.0, 2.0, "test")
IB = Link("ib", 10.0, 10.0, "test")
MB = 10**6


def test_one_node_is_a_ring_over_the_intra_node_link() -> None:
    expected = 2 * 7 * 2e-6 + 2 * 7 / 8 * 100 * MB / 100e9
    assert allreduce_seconds(100 * MB, Layout(8, 1, NVLINK, IB)) == pytest.approx(expected)


def test_hierarchical_all_reduce_beats_a_flat_ring_when_the_network_is_slower() -> None:
    flat = allreduce_seconds(100 * MB, Layout(16, 2, NVLINK, IB, hierarchical=False))
    hierarchical = allreduce_seconds(100 * MB, Layout(16, 2, NVLINK, IB, hierarchical=True))
    assert flat == pytest.approx(2 * 15 * 10e-6 + 2 * 15 / 16 * 100 * MB / 10e9)
    # within the node: reduce-scatter + all-gather of 100 MB; across: all-reduce of 100/8 MB over 2 nodes
    expected = 2 * (7 * 2e-6 + 7 / 8 * 100 * MB / 100e9) + 2 * 1 * 10e-6 + 100 * MB / 8 / 10e9
    assert hierarchical == pytest.approx(expected) and hierarchical < flat / 5


def test_a_bucket_hides_only_behind_the_backward_compute_after_it() -> None:
    one_ms = lambda nbytes: 1e-3  # noqa: E731 - every all-reduce takes 1 ms
    assert exposed_comm([(0.0, 1)], one_ms) == pytest.approx((1e-3, 1e-3))  # ready at the end: all exposed
    assert exposed_comm([(5e-3, 1), (3e-3, 1)], one_ms)[0] == 0.0  # both finish before backward ends
    # three buckets ready 1.5 ms before the end queue behind each other: 3 ms of work, 1.5 ms exposed
    assert exposed_comm([(1.5e-3, 1)] * 3, one_ms) == pytest.approx((1.5e-3, 3e-3))


def test_the_link_fit_recovers_alpha_and_bandwidth() -> None:
    truth = Link("t", 2.5, 40.0, "")
    sizes = [4**k for k in range(4, 12)]
    times = [allreduce_seconds(s, Layout(4, 1, truth, truth)) for s in sizes]
    fitted = fit_link(sizes, times, 4)
    assert fitted.bandwidth_gbps == pytest.approx(2.5, rel=1e-6) and fitted.latency_us == pytest.approx(40.0)


BASE = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 256, "seq_len": 16, "global_batch_size": 4,
             "micro_batch_size": 2},
    "train": {"steps": 6, "log_every": 2, "eval_every": 0},
    "parallel": {"bucket_cap_mb": 0.01, "wrap_single": True},  # one rank: DDP anyway, to record its buckets
}


@pytest.fixture(scope="module")
def calibration_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    (run,) = run_distributed(train_each, 1, str(tmp_path_factory.mktemp("cal")), BASE, [{}], timeout=600)[0]
    return Path(run["dir"])


def test_a_run_records_its_buckets_and_predicts_itself(calibration_run: Path) -> None:
    summary = json.loads((calibration_run / "summary.json").read_text())
    cal = Calibration.from_run(str(calibration_run))
    assert cal.buckets_measured and len(cal.buckets) > 2 and cal.grad_accum == 2
    assert sum(n for _, n in cal.buckets) == 4 * summary["parameters"]  # every fp32 gradient, once
    assert all(lead >= 0 for lead, _ in cal.buckets) and min(lead for lead, _ in cal.buckets) == 0.0
    itself = predict(cal, Layout(1, 1, NVLINK, IB))
    assert itself.step_s == pytest.approx(summary["time_step_s"], rel=0.25)
    two = predict(cal, Layout(2, 1, NVLINK, IB))  # weak scaling: same work per rank, plus the gradient sync
    assert two.batch.global_batch_size == 8 and two.compute_s == itself.compute_s and two.step_s > itself.step_s


def test_dry_run_prints_the_prediction(calibration_run: Path, tmp_path: Path) -> None:
    result = run_cli(["launch.dry_run=true", f"plan.from_run={calibration_run}", "plan.world_size=16",
                      "plan.nodes=2"], cwd=tmp_path, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in ("Calibrated from", "1 node x 8 (nvlink)", "2 nodes x 8 (nvlink + infiniband_ndr, hierarchical)",
                 "2 nodes x 8 (nvlink + infiniband_ndr, flat ring)", "efficiency"):
        assert text in result.stdout, result.stdout
    bad = run_cli(["launch.dry_run=true", f"plan.from_run={tmp_path}/nope"], cwd=tmp_path, cache=tmp_path)
    assert bad.returncode == 2 and "plan.from_run=" in bad.stderr and "summary.json" in bad.stderr


def test_nodes_must_divide_the_world_size(calibration_run: Path) -> None:
    from ddptrain.config import PlanConfig
    from ddptrain.predict import what_if

    with pytest.raises(ConfigError, match=r"plan\.nodes=3: expected a positive divisor of plan\.world_size=16"):
        what_if(PlanConfig(from_run=str(calibration_run), world_size=16, nodes=3), 1)
