"""What the launcher decides before any worker starts (``ddptrain/app/before_start.py``), in-process and fast.

``ddptrain launch.nproc_per_node=2`` runs here with torch's elastic ``run`` replaced by a recorder: a refusal is
one line, exit 2, with no worker started and nothing written into the run directory; a run that may start
reaches the spawn. The checkpoints are written as the checkpointer writes them (a real model's fingerprint, its
``hf/`` config, the run's ``config.yaml``, a DCP ``state/``, the marker with every file's checksum).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.run as torch_run
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddptrain.app import cli
from ddptrain.app.cli import run_cli
from ddptrain.checkpoint.format import FORMAT, MANIFEST_KEY, MARKER, TrainState, manifest, model_fingerprint
from ddptrain.config.compose import PRIMARY, Source, compose_config, typed_config
from ddptrain.errors import ConfigError, ResourceError
from ddptrain.models.build import build_model
from ddptrain.runtime.imports import imports_without_the_collector
from ddptrain.telemetry.logs import ELASTIC_LOGGERS

QUICK = ["+experiment=quickstart", "data=synthetic", "data.vocab_size=8192"]  # llama_tiny, 2 ranks, no corpus
LAUNCH_ENV = ("DDPTRAIN_RUN_DIR", "DDPTRAIN_LAUNCH_START", "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def write_checkpoint(run_dir: Path, overrides: list[str], step: int = 2) -> Path:
    """A committed checkpoint of the model ``overrides`` compose, as ``Checkpointer.save`` lays it out."""
    typed = typed_config(compose_config(Source(None, PRIMARY, [*QUICK, *overrides]))).typed
    model = build_model(typed.model, 8192)
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    (ckpt / "rng").mkdir(parents=True)
    torch.save(vars(TrainState(step, {}, 0, 0, 2, 16, 0)), ckpt / "trainer.pt")
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(typed)))
    model.config.save_pretrained(str(ckpt / "hf"))
    dcp.save({"model.w": torch.zeros(2)}, checkpoint_id=str(ckpt / "state"), no_dist=True)
    meta = {"format": FORMAT, "step": step, "fingerprint": model_fingerprint(model), "strategy": "torch DDP",
            "zero_stage": 0, "world_size": 2, "parameters": 1, MANIFEST_KEY: manifest(ckpt)}
    (ckpt / MARKER).write_text(json.dumps(meta) + "\n")
    (run_dir / "config.yaml").write_text("the earlier run's config\n")
    return ckpt


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a committed llama_tiny checkpoint (tests copy what they change)."""
    run_dir = tmp_path_factory.mktemp("llama") / "run"
    write_checkpoint(run_dir, [])
    return run_dir


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The command in ``tmp_path`` with the elastic launch recorded instead of run; returns the recorded spawns."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    for name in LAUNCH_ENV:  # the launcher sets them for its workers: put back after the test
        monkeypatch.setenv(name, "")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PET_NNODES"):
        monkeypatch.delenv(name, raising=False)
    spawned: list[Any] = []
    monkeypatch.setattr(torch_run, "run", spawned.append)
    yield spawned
    for name in ELASTIC_LOGGERS:  # the launcher's handler on torch elastic's loggers (the run dir's train.log)
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()


def refused(capsys: pytest.CaptureFixture[str], spawned: list[Any], args: list[str], message: str) -> None:
    """``ddptrain args`` exits 2 within seconds with ``message`` as its one line, before any worker starts."""
    start = time.monotonic()
    code = run_cli([*QUICK, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, spawned) == (2, []), (code, err)
    assert len(err) == 1 and err[0].startswith("ddptrain: error: ") and message in err[0], err
    assert time.monotonic() - start < 20


def test_an_unwritable_run_dir_is_refused_before_any_worker_starts(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "README.md").write_text("a file, not a directory")
    refused(capsys, launcher, ["hydra.run.dir=README.md/run"],
            f"hydra.run.dir={tmp_path}/README.md/run: cannot write there (Not a directory)")


def test_a_run_dir_holding_another_runs_checkpoints_is_refused_and_left_as_it_was(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], llama_run: Path
) -> None:
    before = {p: p.stat().st_mtime_ns for p in llama_run.rglob("*")}
    refused(capsys, launcher, [f"hydra.run.dir={llama_run}"],
            f"hydra.run.dir={llama_run}: holds committed checkpoints of another run (latest step_000002)")
    assert {p: p.stat().st_mtime_ns for p in llama_run.rglob("*")} == before
    assert (llama_run / "config.yaml").read_text() == "the earlier run's config\n"


@pytest.mark.parametrize("model", [["model=qwen3_tiny"], ["model.num_kv_heads=2"]],
                         ids=["another architecture", "other shapes of the same width"])
def test_resume_auto_of_another_models_checkpoint_is_refused_and_the_run_dir_kept(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], llama_run: Path, model: list[str]
) -> None:
    """qwen3 against llama is decided from the configs; 2 KV heads against 4 needs the model's shapes (built on
    the meta device)."""
    before = {p: p.stat().st_mtime_ns for p in llama_run.rglob("*")}
    refused(capsys, launcher, [*model, f"hydra.run.dir={llama_run}", "train.resume=auto"],
            f"train.resume: {llama_run}/checkpoints/step_000002 was saved for a different model")
    assert {p: p.stat().st_mtime_ns for p in llama_run.rglob("*")} == before  # config.yaml too


def test_an_explicit_damaged_checkpoint_is_refused_and_leaves_no_run_dir(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "old", [])
    damaged = next((ckpt / "state").glob("*.distcp"))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit: same size, another checksum
    damaged.write_bytes(bytes(data))
    refused(capsys, launcher, [f"train.resume={ckpt}", "hydra.run.dir=new"],
            f"train.resume={ckpt}: {ckpt} is damaged: state/{damaged.name}: checksum mismatch")
    assert not (tmp_path / "new").exists()  # no config.yaml, train.log, hang/ or checkpoints/


def test_a_resume_of_this_models_checkpoint_reaches_the_workers(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], llama_run: Path
) -> None:
    """The same model, and one whose change leaves every shape as it was (untied embeddings: the state names
    the head either way), are started; the first line comes before the workers."""
    for extra in ([], ["model.tie_embeddings=false"]):
        assert run_cli([*QUICK, *extra, f"hydra.run.dir={llama_run}", "train.resume=auto"]) == 0
    assert len(launcher) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert f"run dir {llama_run} | 2 ranks | global batch 16 = micro batch 8 x grad accum 1 x dp 2" in first, first


def test_a_worker_that_said_its_line_gives_the_command_its_exit_code(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers that exit 4 (replicas drifted; their line printed once) make the command exit 4 with no line of
    its own; a worker that died of a crash (exit 1) still gets the launcher's line."""
    def failed(codes: dict[int, int]) -> Any:
        def run(args: Any) -> None:
            raise ChildFailedError("ddptrain", {rank: ProcessFailure(rank, 100 + rank, code, str(tmp_path / "none"))
                                                for rank, code in codes.items()})
        return run

    monkeypatch.setattr(torch_run, "run", failed({0: 4, 1: -int(signal.SIGTERM)}))
    assert run_cli([*QUICK, "hydra.run.dir=run"]) == 4
    assert "ddptrain: worker rank" not in capsys.readouterr().err
    monkeypatch.setattr(torch_run, "run", failed({1: 1}))
    assert run_cli([*QUICK, "hydra.run.dir=run2"]) == 1
    assert "ddptrain: worker rank 1 failed with exit code 1" in capsys.readouterr().err


def test_a_replica_group_run_over_a_groups_checkpoints_is_refused_once_before_anything_starts(
    tmp_path: Path, launcher: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under ft.replica_groups each group keeps its checkpoints in ``<run dir>/group<G>/``. A new run over a
    group's committed checkpoints is refused by the launcher in one line, exit 2, before the run's first line,
    the lighthouse and the groups' agents; each agent found it only after all had started, and every group said
    it (two lines for two groups). Continued with train.resume=auto, the same run dir is accepted."""
    from ddptrain.app import ft_launch

    write_checkpoint(tmp_path / "run" / "group1", [])
    starts: list[str] = []

    class Recorded:  # the lighthouse or a group's agent, had the launch started one
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            starts.append(type(self).__name__)
            raise RuntimeError("started")

    monkeypatch.setattr(ft_launch, "Lighthouse", Recorded)
    groups = ["ft.replica_groups=2", "ft.min_replicas=2", "launch.nproc_per_node=1", "hydra.run.dir=run"]
    refused(capsys, starts, groups,
            f"hydra.run.dir={tmp_path / 'run' / 'group1'}: holds committed checkpoints of another run (latest "
            "step_000002); continue it with train.resume=auto, or start in a new hydra.run.dir "
            "(checkpoint.overwrite=true replaces them)")
    with pytest.raises(RuntimeError, match="started"):  # accepted: the launch goes on to start the lighthouse
        run_cli([*QUICK, *groups, "train.resume=auto"])
    assert starts == ["Recorded"]


def test_a_continued_runs_failure_is_judged_by_its_own_evidence_not_the_earlier_launchs_hang(
    tmp_path: Path, launcher: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run dir holds the evidence of an earlier launch's hang (rank 1 hung at step 4 in data loading, rank 0
    waited); continued there, this launch's workers fail before any of them wrote its own (exit 1: a process group
    that never formed): the launcher says a worker failed, not the old hang. Evidence its workers do write (rank 1
    killed at step 9 in backward) is read: the launch's start is taken before its workers start."""
    from ddptrain.diagnose.evidence import HANG_DIR
    from ddptrain.diagnose.whereabouts import Whereabouts

    hang = tmp_path / "run" / HANG_DIR
    hang.mkdir(parents=True)
    earlier = time.time() - 600
    for rank, reason, phase in ((0, "collective timed out", "loss mean"), (1, "SIGTERM from the launcher", "data")):
        collectives = [{"seq": s, "op": "all_reduce", "sizes": [], "bytes": 8} for s in range(40, 42 - rank)]
        (hang / f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "host": "vm", "pid": 1, "time": earlier, "reason": reason, "error": None, "step": 4,
            "phase": phase, "where": "ddptrain/data/loader.py:88" if rank else None, "collectives": collectives}))
    where = Whereabouts()
    where.open(hang / "rank1.where")
    where.at("data", 4)
    where.close()
    os.utime(hang / "rank1.where", (earlier, earlier))

    def failed(args: Any) -> None:
        if fresh:  # this launch's rank 1 is killed in backward at step 9; rank 0 then fails too
            rank1 = Whereabouts()
            rank1.open(hang / "rank1.where")
            rank1.at("backward", 9)
            rank1.close()
            # dated now, exactly: a kernel that stamps file times from a coarse clock (millisecond ticks, before
            # Linux 6.13) could date a file written this soon after the launch's start before it
            written = time.time()
            os.utime(hang / "rank1.where", (written, written))
            time.sleep(0.05)  # the failure comes later than the evidence
        raise ChildFailedError("ddptrain", {1: ProcessFailure(1, 101, -int(signal.SIGKILL), str(tmp_path / "none")),
                                            0: ProcessFailure(0, 100, 1, str(tmp_path / "none"))} if fresh else
                               {r: ProcessFailure(r, 100 + r, 1, str(tmp_path / "none")) for r in (0, 1)})

    monkeypatch.setattr(torch_run, "run", failed)
    fresh = False
    assert run_cli([*QUICK, "hydra.run.dir=run", "train.resume=auto"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptrain:")]
    assert errors == ["ddptrain: worker rank 0 failed with exit code 1"], errors
    fresh = True
    assert run_cli([*QUICK, "hydra.run.dir=run", "train.resume=auto"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptrain:")]
    assert errors == ["ddptrain: error: rank 1 (host vm) died of SIGKILL (the OOM killer, or kill -9) at step 9 in "
                      "backward"], errors


@pytest.mark.parametrize(("rank", "printed", "slept"), [("0", True, False), ("1", True, True)])
def test_a_workers_refusal_is_said_at_once_by_rank_0_and_by_another_rank_only_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: str, printed: bool,
    slept: bool,
) -> None:
    """Every rank finds a refused input alike: rank 0 prints it at once and ends; another rank waits out the
    grace first, by when the elastic agent has stopped it (so the line is printed once), unless rank 0 did not
    fail."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's own handlers
    sleeps: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", sleeps.append)
    assert run_cli(["data.global_batch_size=3"]) == 2
    assert ("ddptrain: error: data.global_batch_size=3" in capsys.readouterr().err) == printed
    assert bool(sleeps) == slept


def test_a_restarted_worker_of_a_launch_that_refused_ends_at_once_with_its_code_and_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Torch's agent restarts refused workers while restarts remain. The worker that said the refusal records its
    code for its launch (``<run dir>/ended.json``, its run id); a restarted worker of that launch ends with it
    before composing anything, silently. A first attempt, another launch's workers, and codes a restart can
    change (1: a crash) are not held."""
    monkeypatch.chdir(tmp_path)
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("TORCHELASTIC_RUN_ID", "launch-a"),
                        ("TORCHELASTIC_RESTART_COUNT", "0"), ("DDPTRAIN_RUN_DIR", str(tmp_path / "run"))):
        monkeypatch.setenv(name, value)
    assert run_cli(["data.global_batch_size=3"]) == 2  # said, and recorded
    assert "ddptrain: error: data.global_batch_size=3" in capsys.readouterr().err
    marker = tmp_path / "run" / "ended.json"
    assert json.loads(marker.read_text()) == {"run_id": "launch-a", "exit_code": 2}
    composed: list[Any] = []
    monkeypatch.setattr(cli, "compose_config", lambda source: composed.append(source) or compose_config(source))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_cli(["+experiment=quickstart", "--cfg", "job"]) == 2  # a restart: the refusal stands, said once
    assert capsys.readouterr() == ("", "") and composed == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")  # another launch's restart: the marker is not its own
    assert run_cli(["+experiment=quickstart", "--cfg", "job"]) == 0 and len(composed) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a first attempt never reads it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    assert run_cli(["+experiment=quickstart", "--cfg", "job"]) == 0 and len(composed) == 2
    capsys.readouterr()
    marker.unlink()
    monkeypatch.setattr(cli, "compose_config", lambda source: (_ for _ in ()).throw(ResourceError("disk full")))
    assert run_cli(["+experiment=quickstart"]) == 1  # a crash-like end: a restart may fare better
    assert not marker.exists()


def test_the_launcher_removes_its_workers_settled_code_when_they_have_ended(
    tmp_path: Path, launcher: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ended.json`` holds for the launch's own attempts: once the workers ended (refused, exit 2 with their one
    line), the launcher removes it and exits 2 with no line of its own."""
    def refused_workers(args: Any) -> None:
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "ended.json").write_text(json.dumps({"run_id": "x", "exit_code": 2}))
        raise ChildFailedError("ddptrain", {0: ProcessFailure(0, 100, 2, str(tmp_path / "none"))})

    monkeypatch.setattr(torch_run, "run", refused_workers)
    assert run_cli([*QUICK, "hydra.run.dir=run"]) == 2
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptrain: ")]
    assert not (tmp_path / "run" / "ended.json").exists()


def test_a_replica_groups_agent_leaves_a_failed_worker_to_the_groups_launcher(
    tmp_path: Path, launcher: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group's agent whose worker failed with no evidence of why (exit 1, its restarts spent) exits 1 without a
    line: the groups' launcher says which group failed and with what code (``app/ft_launch.py``), or why it stopped
    the run (a quorum loss, which the worker leaves to it). Before, the agent's generic line came first: two lines
    for one failure. A plain launch still says it, and so does a group's agent with no groups' launcher above it (a
    Kubernetes pod of one group: ``ft.replica_id`` set, no launcher's mark). Evidence of who hung or died is the
    agent's line under the groups' launcher too."""
    import ddptrain.diagnose.verdict as diagnose_verdict
    from ddptrain.ft.layout import GROUP_AGENT_ENV

    def failed(args: Any) -> None:
        raise ChildFailedError("ddptrain", {0: ProcessFailure(0, 100, 1, str(tmp_path / "none"))})

    monkeypatch.setattr(torch_run, "run", failed)
    monkeypatch.setattr("ddptrain.ft.extra.require_torchft", lambda groups: None)
    group = ["ft.replica_groups=2", "ft.min_replicas=2", "launch.nproc_per_node=1", "ft.replica_id=1",
             "ft.lighthouse=http://localhost:29510"]
    assert run_cli([*QUICK, "hydra.run.dir=plain"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "ddptrain: worker rank 0 failed with exit code 1"
    assert run_cli([*QUICK, *group, "hydra.run.dir=pod"]) == 1  # one group's pod: nobody else would say it
    assert capsys.readouterr().err.splitlines()[-1] == "ddptrain: worker rank 0 failed with exit code 1"
    monkeypatch.setenv(GROUP_AGENT_ENV, "1")
    assert run_cli([*QUICK, *group, "hydra.run.dir=run"]) == 1
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptrain:")]
    assert (tmp_path / "run" / "group1").is_dir()  # the group's own agent, in its folder
    monkeypatch.setattr(diagnose_verdict, "verdict", lambda *args, **kwargs: "rank 0 hung at step 3 in backward")
    assert run_cli([*QUICK, *group, "hydra.run.dir=hung"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "ddptrain: error: rank 0 hung at step 3 in backward"


@pytest.mark.parametrize(("extra", "cores", "load", "threads", "noted"), [
    (["launch.nproc_per_node=4", "data.micro_batch_size=4"], 2, 0.0, "1", True),  # 4 workers on 2 cores
    ([], 4, 6.0, "1", False),  # 2 workers; the rest of the machine keeps the 4 cores busy
    ([], 4, 0.0, "2", False),  # 2 workers on a quiet machine: a share of the cores each
])
def test_the_launcher_gives_its_workers_the_idle_cores_and_notes_more_workers_than_cores(
    extra: list[str], cores: int, load: float, threads: str, noted: bool, launcher: list[Any],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """launch_workers' own wiring (app/launch.py), not only runtime/topology.py's rules: the workers' OMP_NUM_THREADS
    follows the load average, and the oversubscription note is printed before they start."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.delenv("OMP_NUM_THREADS")  # the launcher only sets what the user did not
    assert run_cli([*QUICK, "hydra.run.dir=run", *extra]) == 0
    assert len(launcher) == 1
    assert os.environ["OMP_NUM_THREADS"] == threads
    notes = [line for line in capsys.readouterr().err.splitlines() if "ddptrain: note: launch.nproc_per_node" in line]
    assert len(notes) == (1 if noted else 0), notes


# --- the audit of the change (docs/mutation.md): what the tests above did not vary ---------------------------------


def test_a_run_dir_under_parents_that_do_not_exist_yet_reaches_the_workers(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """The nearest existing parent decides (here ``tmp_path``, two levels up), not the run dir's parent."""
    assert run_cli([*QUICK, "hydra.run.dir=new/nested/run"]) == 0, capsys.readouterr().err
    assert len(launcher) == 1


def test_a_run_dir_this_process_may_not_write_in_is_refused(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.access as a non-root user sees for a read-only directory (this suite may run as root, which may write
    anywhere): only ``tmp_path/locked`` is refused."""
    from ddptrain.app import before_start

    locked = tmp_path / "locked"
    locked.mkdir()
    real = before_start.os.access
    monkeypatch.setattr(before_start.os, "access", lambda path, mode: Path(path) != locked and real(path, mode))
    refused(capsys, launcher, ["hydra.run.dir=locked/run"],
            f"hydra.run.dir={locked}/run: cannot write there (Permission denied)")
    assert run_cli([*QUICK, "hydra.run.dir=open/run"]) == 0 and len(launcher) == 1


def test_an_explicit_resume_is_compared_with_its_own_checkpoint_not_the_run_dirs(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], llama_run: Path
) -> None:
    """A run dir holding llama checkpoints, resuming a qwen3 checkpoint named by path: a qwen3 run is started,
    a llama run refused (qwen3's checkpoint is the one it would load)."""
    qwen = write_checkpoint(tmp_path / "qwen", ["model=qwen3_tiny"])
    assert run_cli([*QUICK, "model=qwen3_tiny", f"hydra.run.dir={llama_run}", f"train.resume={qwen}"]) == 0
    first = capsys.readouterr().err
    assert len(launcher) == 1, first
    refused(capsys, launcher[1:], [f"hydra.run.dir={llama_run}", f"train.resume={qwen}"],
            f"train.resume: {qwen} was saved for a different model")


def test_resume_with_another_vocabulary_size_is_refused(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], llama_run: Path
) -> None:
    """model.vocab_size changes the embedding's rows: every other shape key equal does not make it the same
    model."""
    refused(capsys, launcher, ["model.vocab_size=16384", f"hydra.run.dir={llama_run}", "train.resume=auto"],
            f"train.resume: {llama_run}/checkpoints/step_000002 was saved for a different model")


@pytest.mark.parametrize("code", [2, 3])
def test_a_worker_refusal_or_abort_is_the_commands_exit_code_without_a_launcher_line(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    code: int,
) -> None:
    def run(args: Any) -> None:
        raise ChildFailedError("ddptrain", {0: ProcessFailure(0, 100, code, str(tmp_path / "none"))})

    monkeypatch.setattr(torch_run, "run", run)
    assert run_cli([*QUICK, "hydra.run.dir=run"]) == code
    assert "ddptrain: worker rank" not in capsys.readouterr().err


def test_a_stop_before_any_checkpoint_adds_a_line_for_sigterm_and_none_for_ctrl_c(
    tmp_path: Path, launcher: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Ctrl-C rank 0's own line says what was interrupted: the launcher adds nothing after its first line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    for sig in (signal.SIGINT, signal.SIGTERM):
        def stopped(args: Any, sig: signal.Signals = sig) -> None:
            raise SignalException("stopped", sig)

        monkeypatch.setattr(torch_run, "run", stopped)
        assert run_cli([*QUICK, f"hydra.run.dir=run_{sig.name}"]) == 128 + sig.value
        lines = capsys.readouterr().err.strip().splitlines()
        assert [line for line in lines if "stopped by" in line] == (
            [] if sig == signal.SIGINT else
            [f"ddptrain: stopped by SIGTERM before this launch committed a checkpoint (run dir {tmp_path}/run_SIGTERM)"]
        ), lines


def test_discarded_evidence_goes_unless_something_was_recorded(tmp_path: Path) -> None:
    """A rank that ended well leaves no hang/; one that recorded a hang keeps its record and stacks (the launcher's
    verdict reads it)."""
    import faulthandler
    import sys

    from ddptrain.diagnose.evidence import Evidence
    from ddptrain.diagnose.whereabouts import WHEREABOUTS

    previous = signal.getsignal(signal.SIGTERM)
    try:
        Evidence(tmp_path / "healthy", 0).discard()
        assert not (tmp_path / "healthy" / "hang").exists()
        hung = Evidence(tmp_path / "hung", 1)
        hung.record("a collective timed out")
        hung.discard()
        assert (tmp_path / "hung" / "hang" / "rank1.json").is_file()
        stacks = (tmp_path / "hung" / "hang" / "rank1.stacks").read_text()
        assert "a collective timed out: every thread's stack" in stacks
    finally:
        WHEREABOUTS.close()
        faulthandler.enable(sys.__stderr__, all_threads=True)
        signal.signal(signal.SIGTERM, previous)


def worker_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> Any:
    """``run_worker`` as a launcher's worker calls it (a device given: the launcher's checks are not made), one
    rank in this process; returns the exception it ended with."""
    from ddptrain.app.launch import run_worker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PET_NNODES", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    run = typed_config(compose_config(Source(None, PRIMARY, [*QUICK, "launch.nproc_per_node=1", *overrides])))
    previous = signal.getsignal(signal.SIGTERM)  # the worker's evidence handler
    try:
        run_worker(run, torch.device("cpu"))
    except (ConfigError, KeyboardInterrupt) as exc:
        return exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise AssertionError("the worker ran to its end")


def test_a_quorum_loss_is_left_to_the_groups_launcher_and_said_by_a_group_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group's worker that found no quorum in time exits 1 without a line under the groups' launcher, which reads
    the loss from the group's events and says whether the run stops (before: the worker's line, then the
    launcher's, for one stop); a group with no launcher above it (a Kubernetes pod of its own) says it."""
    from ddptrain.app import launch
    from ddptrain.errors import QuorumLost
    from ddptrain.ft.layout import GROUP_AGENT_ENV

    code = [1]

    def no_quorum(run: Any, device: Any = None) -> None:
        raise QuorumLost("replica group 1: no quorum of ft.min_replicas=2 groups within ft.quorum_timeout_s=5",
                         code[0])

    monkeypatch.setattr(launch, "run_worker", no_quorum)
    monkeypatch.setattr("ddptrain.ft.extra.require_torchft", lambda groups: None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "quorum")  # a worker an agent started
    group = ["ft.replica_groups=2", "ft.min_replicas=2", "launch.nproc_per_node=1", "ft.replica_id=1",
             "ft.lighthouse=http://localhost:29510", "hydra.run.dir=run"]
    assert run_cli([*QUICK, *group]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == ("ddptrain: replica group 1: no quorum of ft.min_replicas=2 "
                                                         "groups within ft.quorum_timeout_s=5")
    code[0] = 3  # the end's own exit code, whoever says the line
    assert run_cli([*QUICK, *group]) == 3
    capsys.readouterr()
    for mark in ("1", ""):  # the launcher's mark is its presence, as the agent reads it (app/launch.py)
        monkeypatch.setenv(GROUP_AGENT_ENV, mark)
        assert run_cli([*QUICK, *group]) == 3
        assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddptrain:")]


def collector_in_the_import_block(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the collector was on, each time ``app/launch.py`` entered its start-up import block."""
    from ddptrain.app import launch

    during: list[bool] = []
    real = launch.imports_without_the_collector

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:
        with real():
            during.append(gc.isenabled())
            yield

    monkeypatch.setattr(launch, "imports_without_the_collector", recorded)
    return during


def test_a_workers_start_up_imports_run_without_the_collector_which_is_on_again_to_build_and_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's imports (torch, the trainer, transformers' model classes) run with Python's cyclic collector
    off (``runtime/imports.py``); the trainer is built, and trains, with it on."""
    from ddptrain.app import launch
    from ddptrain.train import trainer

    during = collector_in_the_import_block(monkeypatch)
    building: list[bool] = []

    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        building.append(gc.isenabled())
        raise ConfigError("built no further")

    logging_set_up: list[bool] = []
    setup_logging = launch.setup_logging

    def logging_recorded(*args: Any, **kwargs: Any) -> None:  # its first call imports transformers
        logging_set_up.append(gc.isenabled())
        setup_logging(*args, **kwargs)

    monkeypatch.setattr(launch, "setup_logging", logging_recorded)
    monkeypatch.setattr(trainer.Trainer, "__init__", build)
    assert str(worker_in_process(tmp_path, monkeypatch, [])) == "built no further"
    assert (during, building, logging_set_up[0]) == ([False], [True], False)


def test_the_launchers_imports_of_torchs_agent_run_without_the_collector(launcher: list[Any],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    during = collector_in_the_import_block(monkeypatch)
    assert run_cli([*QUICK, "hydra.run.dir=plain"]) == 0
    assert during == [False] and len(launcher) == 1 and gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_imports_without_the_collector_leave_it_as_they_found_it_even_on_an_error(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(ImportError), imports_without_the_collector():
            assert not gc.isenabled()
            raise ImportError("no such module")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_worker_refusing_the_resume_leaves_the_earlier_config_yaml_and_no_hang_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_run: Path
) -> None:
    """The workers' own check (what the launcher's could not see, or no launcher at all): config.yaml is written
    only once the checkpoint is resumed, and the refusal leaves no hang evidence."""
    shutil.copytree(llama_run, tmp_path / "run")
    exc = worker_in_process(tmp_path, monkeypatch, ["model=qwen3_tiny", "hydra.run.dir=run", "train.resume=auto"])
    assert isinstance(exc, ConfigError) and "was saved for a different model" in str(exc), exc
    assert (tmp_path / "run" / "config.yaml").read_text() == "the earlier run's config\n"
    assert not (tmp_path / "run" / "hang").exists()


def test_ctrl_c_while_a_worker_prepares_the_data_names_that_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddptrain.runtime.starting import INTACT_CACHE, interrupted_line
    from ddptrain.train import trainer

    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "build_token_data", interrupted)
    exc = worker_in_process(tmp_path, monkeypatch, ["hydra.run.dir=run"])
    assert isinstance(exc, KeyboardInterrupt), exc
    assert interrupted_line(exc) == f"interrupted (SIGINT) while preparing the data; {INTACT_CACHE}"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.log"]  # no config.yaml, no hang/


def test_the_interrupted_line_names_the_innermost_part_and_what_is_safe_only_when_something_is() -> None:
    from ddptrain.runtime.starting import interrupted_line, starting

    assert interrupted_line(KeyboardInterrupt()) == "interrupted (SIGINT)"  # outside every part
    with pytest.raises(KeyboardInterrupt) as caught, starting("building the model"), starting("loading weights"):
        raise KeyboardInterrupt
    assert interrupted_line(caught.value) == "interrupted (SIGINT) while loading weights"
