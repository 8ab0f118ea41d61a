"""The README's bad-input table, case by case: one line naming the key or file, non-zero exit, seconds, no hang.

Checks that run before the process group exists are the same code on every rank, so they run in-process here;
``test_cli.py`` runs a representative set under torchrun with 2 ranks, and the cases that can only fail once
ranks have met (checkpoints, the run directory) run under torchrun below.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ddptrain.plan.memory.planner as memory_planner
from ddptrain.app.cli import run_cli as ddptrain_main
from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import DistEnv, pick_device
from tests.helpers.bad_inputs import UNDER_TORCHRUN
from tests.helpers.cli import run_cli
from tests.helpers.run_cache import RunCache
from tests.helpers.worker_run import train_as_the_command

README = Path(__file__).parents[1] / "README.md"


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "empty.txt").write_text("")
    (tmp / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    return {"EMPTY": str(tmp / "empty.txt"), "CORRUPT": str(tmp / "bad.parquet")}


# Refused at once, with no trace of the step (which takes from seconds to a minute): the case, its line, and the
# most seconds it may take in-process (the command adds its start-up)
AT_ONCE = [
    (["data.micro_batch_size=auto", "plan.device_memory_gib=-3"],
     "plan.device_memory_gib=-3.0: expected a positive number of GiB per device (or null: the device's own)", 10),
    (["data.micro_batch_size=auto", "plan.device_memory_gib=4", "model=llama_1b"],
     "data.micro_batch_size=auto: the model state alone (parameters, gradients, optimizer state) needs 16.39 GiB "
     "per rank (parallel.zero_stage=0), over the 3.60 GiB usable", 10),
]

IN_PROCESS = [
    (["optim.lrr=1"], "optim.lrr: Key 'lrr' not in 'OptimConfig'; did you mean optim.lr?"),
    (["train.max_steps=5"], "train.max_steps: Key 'max_steps' not in 'TrainConfig'; did you mean train.steps?"),
    (["data.paths=/x"], "data.paths: Invalid value assigned: str is not a ListConfig, list or tuple; a list is "
                        "written in brackets: data.paths=[/x]"),
    (["data.micro_batch_size=0"], "data.micro_batch_size=0: expected a positive number of sequences"),
    (["train.steps=-1"], "train.steps=-1: expected a positive integer"),
    (["data=files", "data.paths=[EMPTY]"], "empty.txt: the file is empty"),
    (["data=files", "data.paths=[CORRUPT]", "launch.nproc_per_node=1"], "data.paths: cannot read as parquet"),
    (["data.seq_len=1024"], "data.seq_len=1024 exceeds model.max_position_embeddings=512"),
    (["parallel.zero_stage=5"], "parallel.zero_stage=5: expected 0, 1, 2 or 3"),
    (["parallel.zero_stage=3", "parallel.compression=powersgd"],
     "parallel.compression=powersgd cannot be combined with parallel.zero_stage=3"),
    (["parallel.engine=bucketed", "parallel.zero_stage=1"],
     "parallel.engine=bucketed cannot be combined with parallel.zero_stage=1"),
    (["parallel.engine=warp"], "parallel.engine='warp': expected one of torch, naive"),
    (["parallel.compression=zip"], "parallel.compression='zip': expected one of none, fp16"),
    (["+experiment=nope"], "Could not find 'experiment/nope'; available: bucket_sweep, gpt2_small, llama_1b_zero3, "
                           "lora_quickstart, qlora_4b, quickstart"),
    (["data=nope"], "Could not find 'data/nope'; available: files, hub, instruct, stdlib_code, synthetic"),
    (["optim.lr=-1"], "optim.lr=-1.0: expected a positive learning rate"),
    (["train.precision=fp8"], "train.precision='fp8': expected one of auto, fp32, bf16, fp16"),
    (["train.nan_policy=ignore"], "train.nan_policy='ignore': expected one of skip, abort"),
    (["train.drift_policy=ignore"], "train.drift_policy='ignore': expected one of abort, rebroadcast, off"),
    (["data.tokenizer=/no/such/tokenizer"], "data.tokenizer=/no/such/tokenizer: expected a local tokenizer directory"),
    (["model.num_heads=5"], "model.hidden_size=128 is not divisible by model.num_heads=5"),
    (["profile.enabled=true", "train.steps=3"], "profile: wait 5 + warmup 1 + active 2 steps exceed train.steps=3"),
    (["metrics.baseline=/no/such/run"], "metrics.baseline=/no/such/run: expected tokens/s or a run directory"),
    (["dist.backend=nccl"], "dist.backend=nccl needs CUDA devices"),
    (["parallel.zero_stage=3", "parallel.cpu_offload=true"], "parallel.cpu_offload=true needs CUDA devices"),
    (["model.device_map=auto"], "model.device_map=auto would split one model over all GPUs of the node and break "
                                "data parallelism"),
    (["model.quantize=nf4"], "model.quantize=nf4 needs model.lora.enabled=true"),
    (["model.lora.enabled=true", "parallel.zero_stage=3"],
     "model.lora.enabled=true cannot be combined with parallel.zero_stage=3"),
    (["model.lora.r=0"], "model.lora.r=0: expected a positive rank"),
    (["model.checkpoint_reentrant=true", "model.activation_checkpointing=selective"],
     "model.checkpoint_reentrant=true needs model.activation_checkpointing=full (it is selective)"),
    (["model.gradient_checkpointing=true", "model.activation_checkpointing=selective"],
     "model.gradient_checkpointing=true contradicts model.activation_checkpointing=selective: set only "
     "model.activation_checkpointing"),
    (["+experiment=lora_quickstart", "model.pretrained=outputs/none/model"],
     "model.pretrained=outputs/none/model: no such model directory; make a small base model with: "
     "ddptrain +experiment=quickstart hydra.run.dir=outputs/quickstart"),
    (["data=instruct"], "data.tokenizer: prompt_completion data needs the model's own tokenizer"),
    (["data.num_proc=0"], "data.num_proc=0: expected a positive number of processes"),
    (["data.streaming=true"], "data.streaming=true: expected data.source=files or hub, data.format=packed and a "
                              "data.tokenizer"),
    *[(args, message) for args, message, _ in AT_ONCE],
]


@pytest.mark.parametrize(("overrides", "message"), IN_PROCESS, ids=[m[:40] for _, m in IN_PROCESS])
def test_bad_input_is_one_line_and_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], overrides: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = _files(tmp_path)
    args = [next((a.replace(k, v) for k, v in files.items() if k in a), a) for a in overrides]
    start = time.monotonic()
    code = ddptrain_main([*args, "data.max_documents=20"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err and err[-1].startswith("ddptrain: error: ") and message in err[-1], err
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(("overrides", "message", "seconds"), AT_ONCE, ids=[m[:40] for _, m, _ in AT_ONCE])
def test_a_memory_that_cannot_hold_the_run_is_refused_before_any_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], overrides: list[str],
    message: str, seconds: float,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    traced: list[int] = []
    monkeypatch.setattr(memory_planner, "trace_peak", lambda *args, **kwargs: traced.append(1) or pytest.fail(
        "the step was traced"))
    # CPU seconds, not wall: the work a refusal costs does not grow with the machine's load (a wall bound failed at
    # load 16 under mutmut's trampoline: 11.9 s for a 10 s bound)
    start = time.process_time()
    assert ddptrain_main([*overrides, "data=synthetic", "train.steps=1"]) == 2
    assert time.process_time() - start < seconds and not traced
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ddptrain: error: {message}"), err


def test_more_local_processes_than_cuda_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="launch: 4 processes on this node but only 2 CUDA devices"):
        pick_device(DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=4))


SMALL = ["train.steps=2", "train.log_every=1", "data.max_documents=60", "data.global_batch_size=4",
         "data.micro_batch_size=2", "model.num_layers=1", "logger.progress=false", "checkpoint.export=false"]


def _fails_on_both_ranks(args: list[str], cwd: Path, cache: Path, message: str) -> None:
    _fails_on_both_ranks_with(run_cli(args, cwd=cwd, cache=cache, torchrun_nproc=2, timeout=120), message)


def _fails_on_both_ranks_with(result: subprocess.CompletedProcess[str], message: str) -> None:
    """Both ranks find it; it is said once (rank 0's line: the launcher stops the other rank before its own)."""
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("ddptrain: error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert message in errors[0], errors


@pytest.fixture(scope="module")
def small_run(cli_runs: RunCache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of 2 ranks with its checkpoints and ``config.yaml``: what the refusals of a checkpoint
    below start from. Trained as the command's workers would, in forked ranks (``tests/helpers/worker_run.py``):
    the refusals are the command's, the run before them is not (through torchrun it also paid torchrun's agent
    and a torch import per rank, about 12 CPU s). Tests must not change it."""
    run = tmp_path_factory.mktemp("small_run") / "run"
    train_as_the_command([*SMALL, "launch.nproc_per_node=2", f"hydra.run.dir={run}"], cli_runs.data_cache)
    return run


@pytest.mark.slow
def test_corrupt_checkpoint(tmp_path: Path, small_run: Path, cli_runs: RunCache) -> None:
    (ckpt,) = (small_run / "checkpoints").glob("step_*")
    broken = tmp_path / "broken" / ckpt.name
    shutil.copytree(ckpt, broken)  # a whole checkpoint whose trainer state was overwritten
    (broken / "trainer.pt").write_bytes(b"\x00not a torch file")
    _fails_on_both_ranks([*SMALL, f"train.resume={broken}", f"hydra.run.dir={tmp_path}/new"], tmp_path,
                         cli_runs.data_cache, "is damaged: trainer.pt")


@pytest.mark.slow
def test_checkpoint_from_a_different_model_is_refused_and_kept(tmp_path: Path, small_run: Path,
                                                                cli_runs: RunCache) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)  # the shared run stays as it was
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")}
    config = (run / "config.yaml").read_text()
    _fails_on_both_ranks([*SMALL, "model.num_layers=2", f"train.resume={run}", f"hydra.run.dir={run}"], tmp_path,
                         cli_runs.data_cache, "was saved for a different model")
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")} == before
    # under plain torchrun the workers refuse it (no ddptrain launcher checked first): the run's own config stays
    assert (run / "config.yaml").read_text() == config


@pytest.mark.slow
def test_resume_path_that_does_not_exist(tmp_path: Path, cli_runs: RunCache) -> None:
    _fails_on_both_ranks([*SMALL, f"train.resume={tmp_path}/nope", f"hydra.run.dir={tmp_path}/run"], tmp_path,
                         cli_runs.data_cache, f"train.resume={tmp_path}/nope: no such checkpoint or run directory")


@pytest.mark.slow
def test_unwritable_run_directory(tmp_path: Path, cli_runs: RunCache) -> None:
    (tmp_path / "a-file").write_text("x")
    _fails_on_both_ranks([*SMALL, f"hydra.run.dir={tmp_path}/a-file/run"], tmp_path, cli_runs.data_cache,
                         f"hydra.run.dir={tmp_path}/a-file/run: cannot write there")


def _malformed_record_run(tmp_path: Path, pretrained_base: Path) -> tuple[Path, list[str]]:
    """A prompt/completion file whose 7th record's completion is a list, and a fine-tuning run on it (run dir
    ``tmp_path/run``): the file and the run's overrides."""
    records = tmp_path / "pc.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(20)]
    lines[6] = json.dumps({"prompt": "q6", "completion": ["a", "list"]})
    records.write_text("\n".join(lines) + "\n")
    return records, [*SMALL, "data=instruct", "data.source=files", f"data.paths=[{records}]",
                     f"data.tokenizer={pretrained_base}", f"model.pretrained={pretrained_base}",
                     f"hydra.run.dir={tmp_path}/run"]


@pytest.mark.slow
def test_a_malformed_prompt_completion_record_is_one_line(tmp_path: Path, pretrained_base: Path) -> None:
    """The data build raises inside ``datasets``' generator, which wraps it (a ``DatasetGenerationError``
    traceback per rank before): the command prints the record's one line on both ranks instead. With restarts
    left (launch.max_restarts=2), torch's agent restarts the refused workers twice; the restarted ones end at
    once with the same code and say nothing (each attempt built the data again and said the line again)."""
    records, run = _malformed_record_run(tmp_path, pretrained_base)
    # ddptrain's own launcher: torchrun's adds its own
    args = [*run, "launch.nproc_per_node=2", "launch.max_restarts=2"]
    result = run_cli(args, cwd=tmp_path, cache=tmp_path / "cache", timeout=180)  # traceback of the failure
    assert result.returncode == 2, result.stderr[-3000:]  # the workers' own exit code
    assert "Traceback" not in result.stderr and "DatasetGenerationError" not in result.stderr, result.stderr[-3000:]
    _fails_on_both_ranks_with(result, f"ddptrain: error: data.paths: {records}: line 7: 'completion' "
                                      "(data.completion_field) is a list, expected a string")
    # torch elastic's own record of the failed worker ("E... torch/distributed/elastic/multiprocessing/api.py:...]
    # failed (exitcode: 2) local_rank: 0 ...") stays in the run dir's log, off the console
    ended = result.stderr[result.stderr.index("ddptrain: error:"):].splitlines()
    assert all(line.startswith("ddptrain: ") for line in ended if line.strip()), ended
    log = (tmp_path / "run" / "train.log").read_text()
    assert "failed (exitcode: 2)" in log
    # torch's agent logs each attempt's first failed worker: three attempts (the first and its two restarts)
    # exited 2, so the restarts happened, and said nothing
    assert log.count("failed (exitcode: 2)") == 3, log[-3000:]
    assert not (tmp_path / "run" / "ended.json").exists()  # this launch's alone (app/settled.py)


@pytest.mark.slow
def test_a_refusal_every_replica_group_finds_is_said_once(tmp_path: Path, pretrained_base: Path) -> None:
    """Under ft.replica_groups=2 each group is a job of its own, and each group's worker finds the malformed record
    after the groups started: the line is said once for the run (both groups said it before), the run exits with
    the workers' code, and the group's restart (ft.group_restarts=1) says nothing."""
    records, run = _malformed_record_run(tmp_path, pretrained_base)
    args = [*run, "ft.replica_groups=2", "ft.min_replicas=2", "launch.nproc_per_node=1", "ft.group_restarts=1"]
    result = run_cli(args, cwd=tmp_path, cache=tmp_path / "cache", timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    _fails_on_both_ranks_with(result, f"ddptrain: error: data.paths: {records}: line 7: 'completion' "
                                      "(data.completion_field) is a list, expected a string")
    for group in (0, 1):  # the feature was needed: both groups' workers refused (each agent logged its exit 2)
        log = (tmp_path / "run" / f"group{group}" / "train.log").read_text()
        assert "failed (exitcode: 2)" in log, log[-3000:]


def test_an_unknown_key_gets_the_schemas_closest_key_and_no_guess_when_none_is_close() -> None:
    from ddptrain.config.compose import compose_config, typed_config

    for overrides, message in (
        (["trian.steps=5"], "trian: Key 'trian' not in 'Config'; did you mean train?"),
        (["+train.max_steps=5"], "train.max_steps: Key 'max_steps' not in 'TrainConfig'; did you mean train.steps?"),
        (["train.zzz=5"], "train.zzz: Key 'zzz' not in 'TrainConfig'"),
    ):
        with pytest.raises(ConfigError) as refused:
            typed_config(compose_config(overrides))
        assert str(refused.value) == message


def test_readme_table_lists_every_case() -> None:
    table = README.read_text()
    for _, message in [*IN_PROCESS, *UNDER_TORCHRUN]:
        assert message.replace("|", r"\|") in table, f"README's bad-input table is missing: {message}"


def test_a_key_only_loosely_like_the_schemas_gets_no_guess_and_a_scalar_gets_no_bracket_hint() -> None:
    """The guess is for typos: 'precision' is 0.46 alike to 'train' and 'workers' to optim's 'eps' (a loose
    cutoff suggests them); the bracket hint is for a list key given a bare value, not for any value of a wrong
    type ('abc' for train.steps, an integer)."""
    from ddptrain.config.compose import compose_config, typed_config

    for overrides, message in (
        (["+precision=bf16"], "precision: Key 'precision' not in 'Config'"),
        (["+optim.workers=4"], "optim.workers: Key 'workers' not in 'OptimConfig'"),
        (["train.steps=abc"], "train.steps: Value 'abc' of type 'str' could not be converted to Integer"),
    ):
        with pytest.raises(ConfigError) as refused:
            typed_config(compose_config(overrides))
        assert str(refused.value) == message


def test_a_rank_takes_the_cuda_device_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device a rank computes on is made current too (torch.cuda.set_device), so CUDA calls without a device
    (NCCL's communicator, empty_cache) go to the rank's own GPU, not GPU 0."""
    chosen: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pick_device(DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2)) == torch.device("cuda", 1)
    assert chosen == [1]
