"""Two torchrun agents on this machine, as two nodes, train together through the ordinary ``ddptrain`` entry.

They meet through a c10d rendezvous on a loopback endpoint; each "node" has its own data cache (as nodes
without a shared filesystem would) and both write one run directory. Losses equal a single-agent run of the
same world size; a run killed mid-way resumes from its checkpoint after both agents restart.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli, test_env

pytestmark = pytest.mark.slow

RUN = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "logger.progress=false", "data.max_documents=30",
       "data.vocab_size=512", "data.global_batch_size=8", "data.micro_batch_size=2", "data.seq_len=32",
       "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
       "checkpoint.every_n_steps=1", "checkpoint.export=false", "dist.timeout_s=60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_agents(args: list[str], nproc: int, cwd: Path, caches: tuple[Path, Path], fault: str | None = None,
               timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Start two torchrun agents (nodes 0 and 1, ``nproc`` workers each) and wait for both."""
    port = _free_port()
    procs = []
    for node, cache in enumerate(caches):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test-{port}",
                   f"--node-rank={node}", "-m", "ddptrain", *args]
        env = test_env(cache, {"DDPTRAIN_FAULT": fault} if fault else None)
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _assert_same_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got.keys() == expected.keys(), (got, expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-3), f"step {step}: {got[step]} != {loss}"


def test_two_nodes_of_one_rank_match_one_node_and_resume_after_both_agents_restart(tmp_path: Path) -> None:
    caches = (tmp_path / "cache-node0", tmp_path / "cache-node1")
    reference = tmp_path / "reference"
    single = run_cli([*RUN, "launch.nproc_per_node=2", f"hydra.run.dir={reference}"], cwd=tmp_path, cache=caches[0])
    assert single.returncode == 0, single.stderr[-3000:]

    run = tmp_path / "run"
    killed = two_agents([*RUN, f"hydra.run.dir={run}"], 1, tmp_path, caches, fault="kill@step:3")
    assert all(r.returncode != 0 for r in killed), [r.stderr[-2000:] for r in killed]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    for cache in caches:  # each node prepared its own data cache
        assert {p.name.split("-")[0] for p in cache.iterdir()} >= {"bpe", "tokens"}, list(cache.iterdir())

    resumed = two_agents([*RUN, f"hydra.run.dir={run}", "train.resume=auto"], 1, tmp_path, caches)
    assert all(r.returncode == 0 for r in resumed), [r.stderr[-3000:] for r in resumed]
    stderr = "".join(r.stderr for r in resumed)
    assert "resumed from" in stderr and "2 node(s) x 1 rank(s) per node" in stderr
    _assert_same_losses(_losses(run), _losses(reference))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-node0", "cache-node1", "reference", "run"]


def test_two_nodes_of_two_ranks_write_one_run_dir_and_match_one_node_of_four(tmp_path: Path) -> None:
    caches = (tmp_path / "cache-node0", tmp_path / "cache-node1")
    reference = tmp_path / "reference"
    single = run_cli([*RUN, "launch.nproc_per_node=4", f"hydra.run.dir={reference}"], cwd=tmp_path, cache=caches[0])
    assert single.returncode == 0, single.stderr[-3000:]
    results = two_agents(RUN, 2, tmp_path, caches)  # no hydra.run.dir: rank 0's clock names the one run dir
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    (run,) = (tmp_path / "outputs").iterdir()
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"} <= {p.name for p in run.iterdir()}
    _assert_same_losses(_losses(run), _losses(reference))
    assert json.loads((run / "summary.json").read_text())["world_size"] == 4
