"""DiLoCo through the real command (``ft.sync=diloco``): two replica groups of one worker train apart within each
window of ``ft.sync_every`` steps and meet only at its end (the quorum recorded there, the groups' weights equal
there and not in between), ``comm_bytes`` is the outer sync's payload over H, and a run resumed in the middle of
a window ends bit for bit where the uninterrupted one did. The component's own checks are in tests/test_diloco.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ddptrain.checkpoint.offline import read_tensors, tensor_entries
from tests.helpers.cli import run_cli
from tests.helpers.run_cache import RunCache

pytestmark = pytest.mark.slow  # a lighthouse and two groups of workers, twice

STEPS, H = 12, 4
RUN = ["model=llama_tiny", "data.max_documents=40", f"train.steps={STEPS}", "train.log_every=2",
       "train.eval_every=0", "data.global_batch_size=4", "data.micro_batch_size=2", "checkpoint.export=false",
       "checkpoint.every_n_steps=6", "checkpoint.keep_last=5", "logger.progress=false", "hydra.run.dir=run",
       "ft.replica_groups=2", "ft.min_replicas=2", "ft.sync=diloco", f"ft.sync_every={H}"]


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    return read_tensors(checkpoint, [k for k in tensor_entries(checkpoint) if k.startswith("model.")])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def diloco_run(cli_runs: RunCache) -> Path:
    ran = cli_runs.run(RUN, timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.run_dir


def test_groups_meet_only_at_the_end_of_each_window_and_move_an_hth_of_ddps_bytes(diloco_run: Path) -> None:
    ft = json.loads((diloco_run / "ft.json").read_text())
    # the quorum exists only where a window closed: the groups met at steps 4, 8, 12, both of them
    assert ft["quorum_per_step"] == [[s, s, 2] for s in range(H, STEPS + 1, H)]
    summary = json.loads((diloco_run / "summary.json").read_text())
    assert summary["ft"]["sync"] == "diloco" and summary["ft"]["outer_syncs"] == STEPS // H
    # the pseudo-gradients of every trainable fp32 parameter once per window (a group of one rank has no sync
    # inside it); DDP's would be the same bytes every step
    assert summary["comm_bytes"] == pytest.approx(4 * summary["trainable_parameters"] / H)
    # mid-window (step 6) the groups differ: they trained apart; at a window's end (step 12) they are equal
    ckpt = lambda g, s: model_tensors(diloco_run / f"group{g}" / "checkpoints" / f"step_{s:06d}")  # noqa: E731
    assert not same(ckpt(0, 6), ckpt(1, 6))
    assert same(ckpt(0, STEPS), ckpt(1, STEPS))
    losses = [json.loads(line)["loss"] for line in (diloco_run / "group0" / "metrics.jsonl").read_text().splitlines()
              if "loss" in line]
    assert losses[-1] < losses[0]


def test_a_run_resumed_in_the_middle_of_a_window_ends_where_the_uninterrupted_one_did(
        diloco_run: Path, tmp_path: Path, cli_runs: RunCache) -> None:
    """Both groups resume from step 6 (two steps into the second window): the window's start, the outer momentum
    and the position in the window come from the checkpoint, so step 12 is bit for bit the uninterrupted run's."""
    cwd = tmp_path / "cwd"
    shutil.copytree(diloco_run.parent, cwd)
    run = cwd / "run"
    for g in (0, 1):
        for later in sorted((run / f"group{g}" / "checkpoints").glob("step_*")):
            if later.name > "step_000006":
                shutil.rmtree(later)
    resumed = run_cli([*RUN, "train.resume=auto"], cwd=cwd, cache=cli_runs.data_cache, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for g in (0, 1):
        final = f"group{g}/checkpoints/step_{STEPS:06d}"
        assert same(model_tensors(run / final), model_tensors(diloco_run / final)), f"group {g}"
