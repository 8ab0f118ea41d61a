"""A hang or a death is named: the job ends within dist.timeout_s + 45 s of it with one last line saying which rank,
at which step, in which phase, and what the others waited in; no worker outlives it; the raw evidence stays in
<run dir>/hang/.

Each case runs on gloo and on the NCCL-semantics twin (``tests/helpers/nccl_twin.py``: collectives that return at
enqueue so that a waiting rank's host runs ahead, no Python exception from a collective, a watchdog that has the
heartbeat monitor dump NCCL's trace and aborts the waiting rank at dist.timeout_s), and names the same rank on
both. The HSDP case runs 4 ranks as 2 nodes of 2 (``TWIN_NODES``): FSDP2 on the 2-D mesh's shard and replica
groups, one rank stopped in forward while its shard group's peer waits in the FSDP2 all-gather."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from ddptrain.diagnose.evidence import read_nccl_dump
from ddptrain.diagnose.trace import current
from tests.helpers.nccl_twin import ENV as TWIN_ENV
from tests.helpers.staggered import Finished, Job, end_unfinished, run_staggered

ROOT = Path(__file__).parents[1]
SITE = {"PYTHONPATH": str(ROOT / "tests" / "helpers" / "nccl_twin_site")}  # that folder only: never the checkout
BACKENDS = {  # what the real command runs on: gloo itself, or the twin installed into every process
    "gloo": {},
    "nccl_twin": {TWIN_ENV: "1", **SITE},
}

pytestmark = pytest.mark.slow  # the real CLI, 2 to 4 worker processes, a collective timeout each

TIMEOUT_S = 5  # as short as start-up allows: the first collectives and the group's own set-up wait this long too
RUN = ["data=synthetic", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
       "data.seq_len=32", "data.global_batch_size=12", "data.micro_batch_size=2", "train.steps=6",
       "train.log_every=2", "train.eval_every=0", "logger.progress=false", "checkpoint.every_n_steps=2",
       "checkpoint.export=false", f"dist.timeout_s={TIMEOUT_S}",
       "launch.stop_grace_s=1"]  # the hung rank's evidence is written at SIGTERM, before the grace
HSDP = (["parallel.zero_stage=3", "parallel.shard_group=node", "data.global_batch_size=16"],
        {"TWIN_NODES": "2", **SITE})  # 4 ranks as 2 nodes x 2: a 2 x 2 mesh
CASES = {  # fault, ranks, what the last line must say (on gloo only: the last list), overrides and environment
    "data": ("hang@data:3:1", 2, ["rank 1 (host ", "hung at step 3 in data loading (ddptrain/train/observer.py:",
                                  "; rank 0 waited in ", f"for {TIMEOUT_S} s (dist.timeout_s)"], [], ([], {})),
    "forward": ("hang@forward:3:1", 2, ["rank 1 (host ", "hung at step 3 in forward", "; rank 0 waited in "], [],
                ([], {})),
    "save": ("hang@save:4:1", 3, ["rank 1 (host ", "hung at step 4 in a checkpoint save", "; ranks 0, 2 waited in "
                                  "barrier #"], [], ([], {})),
    "dead": ("kill@step:3:1", 2, ["rank 1 (host ", "died of SIGKILL (the OOM killer, or kill -9) at step 3"], [],
             ([], {})),
    "mismatch": ("mismatch@step:3:1", 2, ["mismatched collectives: as collective #", "rank 0 broadcast of ",
                                          "rank 1 all_reduce of 12 bytes"], ["at step 3 in the end of the step"],
                 ([], {})),
    "hsdp": ("hang@forward:3:1", 4, ["rank 1 (host ", "hung at step 3 in forward", "; rank 0 waited in all_gather",
                                     "of group mesh_shard [ranks 0, 1]"], [], HSDP),
}
READY = "step 2/6"  # a run's start-up is done
START_ORDER = ("hsdp", "save", "data", "forward", "mismatch", "dead")  # "dead" waits for no timeout
RUNS_AHEAD = ("data", "forward", "mismatch", "hsdp")  # on the twin: rank 0's host enqueued past its wait


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Finished]]]:
    """The selected cases' runs in two lanes side by side, in each started in turn as the one before has trained to
    step 2 (its start-up done), so that one run's imports overlap the one before's timeout and stop; each case's
    test waits for its own run."""
    cache = tmp_path_factory.mktemp("cache")
    selected = [item.callspec.params for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    # the longest runs first, so that the last to start, whose whole run nothing overlaps, is a short one
    selected.sort(key=lambda params: START_ORDER.index(params["case"]))
    todo: dict[str, Job] = {}
    for params in selected:
        case, backend = params["case"], params["backend"]
        fault, ranks, _, _, (overrides, env) = CASES[case]
        run_dir = tmp_path_factory.mktemp(f"{case}-{backend}")
        todo[f"{case}-{backend}"] = Job([*RUN, *overrides, f"launch.nproc_per_node={ranks}",
                                         f"hydra.run.dir={run_dir}"],
                                        run_dir, cache, {"DDPTRAIN_FAULT": fault, **env, **BACKENDS[backend]})
    yield run_staggered(todo, ready=READY, timeout=TIMEOUT_S + 120, lanes=2)
    end_unfinished()  # a run whose test was deselected or failed before waiting for it: nothing outlives the module


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_hung_dead_or_mismatched_rank_is_named_in_the_last_line(jobs: dict[str, Future[Finished]], case: str,
                                                                   backend: str) -> None:
    _, _, expected, on_gloo, _ = CASES[case]
    expected = [*expected, *(on_gloo if backend == "gloo" else [])]
    result = jobs[f"{case}-{backend}"].result()
    tmp_path = result.cwd
    # from step 2 (the faults strike at step 3 or 4) to the end: a step or two, the timeout, the agent's stop; the
    # start-up before it is the machine's, not the verdict's
    elapsed = result.elapsed - (result.ready_s or 0.0)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ddptrain: error: "), result.stderr[-3000:]
    for part in expected:
        assert part in last, (part, last)
    assert elapsed < TIMEOUT_S + 45, f"took {elapsed:.0f} s after {READY!r}"
    if case != "mismatch":  # gloo's abort prints its own C++ message; every Python rank says one line
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not result.survivors, ("no worker process may outlive the job", result.survivors)
    evidence = tmp_path / "hang"
    assert (evidence / "rank1.where").is_file() and (evidence / "rank0.stacks").is_file()
    if case in ("data", "forward", "save", "hsdp"):
        hung = json.loads((evidence / "rank1.json").read_text())
        assert hung["reason"] == "SIGTERM from the launcher" and hung["collectives"], hung
        assert "Current thread" in (evidence / "rank1.stacks").read_text()  # every thread's stack, dumped
        if backend == "nccl_twin":  # read from the NCCL trace, which says whether each collective finished
            assert all(c["completed"] for c in hung["collectives"]), hung
    if backend == "nccl_twin" and case != "dead":  # the watchdog's dump, where the product pointed it
        assert "Watchdog caught collective operation timeout" in result.stderr, result.stderr[-3000:]
        assert (evidence / "nccl_trace_rank_0").is_file(), sorted(p.name for p in evidence.iterdir())
    if backend == "nccl_twin" and case in RUNS_AHEAD:  # NCCL returns at enqueue: the host went on past its wait
        dump = read_nccl_dump(evidence / "nccl_trace_rank_0")
        assert dump is not None, sorted(p.name for p in evidence.iterdir())
        waited = current(dump["collectives"])
        assert waited is not None and waited is not dump["collectives"][-1], dump["collectives"][-5:]
        if case != "mismatch":  # named as the first unfinished one, not the last enqueued
            assert f"rank 0 waited in {waited['op']} #{waited['seq']}" in last, (waited, last)

