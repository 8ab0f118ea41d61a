"""Checkpoints that cannot run code, damage that is named, runs that never replace another run's checkpoints, and
a full disk told in one line: through the offline tool and the real loop on 2 gloo ranks."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.checkpoint import offline
from ddptrain.checkpoint.cli import run as ckpt_tool
from ddptrain.checkpoint.format import manifest
from tests.helpers.dist import run_distributed
from tests.helpers.runs import Overrides, make_config, train_each, without_the_planned_peak
from tests.helpers.tiny import TINY_MODEL

BASE: Overrides = {
    "model": {**TINY_MODEL, "max_position_embeddings": 32},
    "data": {"source": "synthetic", "vocab_size": 256, "num_samples": 96, "seq_len": 16, "global_batch_size": 8,
             "micro_batch_size": 2},
    "train": {"steps": 4, "log_every": 1, "eval_every": 0},
    "optim": {"warmup_steps": 1},
    "checkpoint": {"every_n_steps": 2, "keep_last": 3},
}
SHARD = "state/__1_0.distcp"  # rank 1's tensors


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run that committed steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("source")
    (result,) = run_distributed(train_each, 2, str(tmp), BASE, [{}])[0]
    run_dir = Path(result["dir"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    return run_dir


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir / "checkpoints", to / "checkpoints")
    return to


def _rerecord(checkpoint: Path) -> None:
    """Renew the marker's sizes and checksums, as someone who planted a file would."""
    meta = json.loads((checkpoint / "COMMITTED").read_text())
    meta["files"] = manifest(checkpoint, skip=frozenset({"COMMITTED"}))
    (checkpoint / "COMMITTED").write_text(json.dumps(meta))


def _train_cases(rank: int, world_size: int, tmp: str, cases: list[tuple[str, Overrides]]) -> list[str | None]:
    """Train each (run dir, overrides) on this rank; the one-line error each ended with (None: trained)."""
    from ddptrain.errors import ConfigError, ResourceError
    from ddptrain.runtime.process_group import DistEnv
    from ddptrain.train.trainer import train

    without_the_planned_peak()  # nothing here reads it
    env = DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    ended: list[str | None] = []
    for run_dir, overrides in cases:
        try:
            train(make_config(tmp, BASE, overrides), env, torch.device("cpu"), Path(run_dir), {})
            ended.append(None)
        except (ConfigError, ResourceError) as exc:
            ended.append(str(exc))
    return ended


# ---- checkpoints that cannot run code ---------------------------------------------------------------------------

class Planted:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.witness}",)


def test_a_planted_code_object_in_trainer_or_rng_files_is_refused_everywhere_without_running(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    witness = tmp_path / "ran"
    planted = {}
    for where in ("trainer.pt", "rng/rank1.pt"):
        run = _copy(source, tmp_path / where.replace("/", "-"))
        checkpoint = run / "checkpoints" / "step_000004"
        state = torch.load(checkpoint / where, weights_only=True)
        state["torch" if "rng" in where else "scheduler"] = Planted(witness)
        torch.save(state, checkpoint / where)
        _rerecord(checkpoint)  # the record matches: only the safe loader stands between the file and the shell
        planted[where] = checkpoint
        for command in (["info", str(checkpoint)], ["verify", str(checkpoint)],
                        ["export", str(checkpoint), str(tmp_path / f"out-{run.name}")]):
            assert ckpt_tool(command) == 2, (where, command)
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"ddptrain-ckpt: error: {checkpoint / where}: refused to load: it needs posix.system"
                                  ), err
            assert "\n" not in err
    ended = run_distributed(_train_cases, 2, str(tmp_path), [
        (str(tmp_path / "resume-explicit"), {"train": {"resume": str(planted["trainer.pt"])}}),
        (str(planted["rng/rank1.pt"].parents[1]), {"train": {"resume": "auto"}}),
    ])
    assert ended[0][0].startswith(f"{planted['trainer.pt'] / 'trainer.pt'}: refused to load"), ended[0]
    assert ended[1][1].startswith(f"{planted['rng/rank1.pt'] / 'rng' / 'rank1.pt'}: refused to load"), ended[1]
    assert not witness.exists(), "the planted object ran"
    torch.load(planted["trainer.pt"] / "trainer.pt", weights_only=False)  # the witness works: unsafe loading runs it
    assert witness.exists()


def test_rng_states_are_plain_types_that_restore_every_generator() -> None:
    import random

    import numpy as np

    from ddptrain.checkpoint.safe import rng_state, set_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian in NumPy's state
    saved = rng_state()
    expected = (random.random(), np.random.standard_normal(), torch.rand(1))
    set_rng_state(saved)
    assert (random.random(), np.random.standard_normal(), torch.rand(1)) == expected


def test_an_earlier_checkpoint_with_numpy_rng_arrays_gets_one_line_then_converts_once(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import random

    import numpy as np

    checkpoint = _copy(source, tmp_path) / "checkpoints" / "step_000004"
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, checkpoint / "rng" / "rank0.pt")  # what earlier versions wrote
    _rerecord(checkpoint)
    assert ckpt_tool(["info", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "refused to load: it needs numpy" in err and f"ddptrain-ckpt convert {checkpoint} --trust" in err
    assert ckpt_tool(["convert", str(checkpoint), "--trust"]) == 0
    assert ckpt_tool(["verify", str(checkpoint)]) == 0, capsys.readouterr()
    from ddptrain.checkpoint.safe import load_plain

    converted = load_plain(checkpoint / "rng" / "rank0.pt")
    assert converted["numpy"]["keys"].tolist() == old["numpy"][1].tolist()


def test_a_metadata_pickle_naming_other_code_is_refused(tmp_path: Path, source: Path) -> None:
    import pickle

    from ddptrain.checkpoint.safe import SafeReader, UnsafeCheckpoint

    state = _copy(source, tmp_path) / "checkpoints" / "step_000004" / "state"
    (state / ".metadata").write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
    with pytest.raises(UnsafeCheckpoint, match=r"posix\.system"):
        SafeReader(str(state)).read_metadata()
    assert not (tmp_path / "ran").exists()


# ---- damaged checkpoints ----------------------------------------------------------------------------------------

def _truncate(checkpoint: Path) -> str:
    path = checkpoint / SHARD
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:100])
    return f"{SHARD}: truncated: 100 of {size} bytes"


def _remove(checkpoint: Path) -> str:
    (checkpoint / SHARD).unlink()
    return f"{SHARD}: missing"


def _flip(checkpoint: Path) -> str:
    data = bytearray((checkpoint / SHARD).read_bytes())
    data[len(data) // 2] ^= 0x01
    (checkpoint / SHARD).write_bytes(bytes(data))
    return f"{SHARD}: checksum mismatch (its contents changed since the commit)"


def _remove_rng(checkpoint: Path) -> str:
    (checkpoint / "rng" / "rank1.pt").unlink()
    return "rng/rank1.pt: missing"


DAMAGE = {"truncated": _truncate, "missing": _remove, "bit-flipped": _flip, "rng-missing": _remove_rng}


def test_damaged_checkpoints_are_named_by_verify_refused_explicitly_and_skipped_by_auto(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases, expected = [], {}
    for name, damage in DAMAGE.items():
        run = _copy(source, tmp_path / name)
        damaged = run / "checkpoints" / "step_000004"
        expected[name] = damage(damaged)
        assert ckpt_tool(["verify", str(damaged)]) == 1
        out = capsys.readouterr()
        assert f"{damaged}: {expected[name]}" in out.out.splitlines(), out
        cases += [(str(tmp_path / f"explicit-{name}"), {"train": {"resume": str(damaged)}}),
                  (str(run), {"train": {"resume": "auto"}})]
    ended = run_distributed(_train_cases, 2, str(tmp_path), cases, timeout=600)
    reference = source / "checkpoints" / "step_000004"
    keys = list(offline.tensor_entries(reference))
    uninterrupted = offline.read_tensors(reference, keys)
    for i, name in enumerate(DAMAGE):
        damaged = tmp_path / name / "checkpoints" / "step_000004"
        for rank in range(2):
            assert ended[rank][2 * i] == (f"train.resume={damaged}: {damaged} is damaged: {expected[name]}; check "
                                          f"it with ddptrain-ckpt verify {damaged}"), (name, ended[rank][2 * i])
            assert ended[rank][2 * i + 1] is None, (name, ended[rank][2 * i + 1])
        kept = damaged.with_name("damaged-step_000004")
        assert kept.is_dir(), f"{name}: the damaged checkpoint must be kept"
        resumed = offline.read_tensors(damaged, keys)  # step 4 again, trained on from the intact step 2
        different = [k for k in keys if not torch.equal(resumed[k], uninterrupted[k])]
        assert not different, f"{name}: not bitwise equal to the uninterrupted run: {different[:3]}"


def test_info_and_export_name_each_damaged_checkpoint_in_one_line_and_export_nothing(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``info`` checks the recorded sizes (a stat per file: it reads no tensor); ``export``, which reads the model's
    tensors, also checks the recorded checksums, so a bit flip is not exported as weights."""
    for name, damage in DAMAGE.items():
        damaged = _copy(source, tmp_path / name) / "checkpoints" / "step_000004"
        expected = damage(damaged)
        out = tmp_path / f"export-{name}"
        commands = [["export", str(damaged), str(out)]] + ([["info", str(damaged)]] if name != "bit-flipped" else [])
        for command in commands:
            assert ckpt_tool(command) == 2, (name, command)
            captured = capsys.readouterr()
            assert captured.err == f"ddptrain-ckpt: error: PATH: {damaged} is damaged: {expected}\n", (name, command)
            assert captured.out == "", (name, command)
        assert not out.exists() or not any(out.iterdir()), name


def test_export_refuses_a_file_or_a_non_empty_directory_and_reads_back_what_it_wrote(
    tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = source / "checkpoints" / "step_000004"
    (tmp_path / "file").write_text("x")
    assert ckpt_tool(["export", str(checkpoint), str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip().endswith("is a file; export writes a directory (choose another path)")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert ckpt_tool(["export", str(checkpoint), str(tmp_path / "full")]) == 2
    assert "directory is not empty; choose another, or pass --overwrite" in capsys.readouterr().err
    assert ckpt_tool(["export", str(checkpoint), str(tmp_path / "full"), "--overwrite"]) == 0
    assert "read back and equal to the checkpoint" in capsys.readouterr().out


def test_export_reports_a_write_that_does_not_read_back(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import PreTrainedModel

    from ddptrain.errors import ConfigError

    real = PreTrainedModel.save_pretrained

    def lossy(self: PreTrainedModel, path: str, **kwargs: Any) -> None:
        real(self, path, **kwargs)
        os.remove(os.path.join(path, "model.safetensors"))  # what a writer that logs and gives up leaves

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", lossy)
    with pytest.raises(ConfigError, match="cannot be read back with transformers"):
        offline.export(source / "checkpoints" / "step_000004", tmp_path / "out")


# ---- runs never replace another run's checkpoints; a full disk is a sentence --------------------------------------

@contextmanager
def _disk_full_at(step_dir: str) -> Iterator[None]:
    """torch.distributed.checkpoint's file writes into ``step_dir`` fail as on a full filesystem."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        if step_dir in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with original(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]


def _train_on_a_full_disk(rank: int, world_size: int, tmp: str, cases: list[tuple[str, Overrides]]) -> list:
    with _disk_full_at("step_000004"):
        return _train_cases(rank, world_size, tmp, cases)


def test_a_fresh_run_into_a_run_dir_with_checkpoints_is_refused_and_leaves_them_byte_identical(
    tmp_path: Path, source: Path
) -> None:
    run = _copy(source, tmp_path / "run")
    before = manifest(run / "checkpoints")
    ended = run_distributed(_train_cases, 2, str(tmp_path), [(str(run), {"train": {"seed": 7}})])
    expected = (f"hydra.run.dir={run}: holds committed checkpoints of another run (latest step_000004); continue "
                "it with train.resume=auto, or start in a new hydra.run.dir (checkpoint.overwrite=true replaces them)")
    assert ended == [[expected], [expected]]
    assert manifest(run / "checkpoints") == before


def test_a_save_onto_a_full_disk_is_one_line_and_the_previous_checkpoint_stays_intact(tmp_path: Path) -> None:
    cases = [(str(tmp_path / "sync"), {}), (str(tmp_path / "async"), {"checkpoint": {"async_save": True}})]
    ended = run_distributed(_train_on_a_full_disk, 2, str(tmp_path), cases)
    for i, (run, _) in enumerate(cases):
        root = Path(run) / "checkpoints"
        for rank in range(2):
            message = ended[rank][i]
            assert message is not None and message.startswith(f"checkpoint of step 4 failed: no space left in {root} "
                                                              "(a checkpoint needs about "), (run, message)
            assert message.endswith(f"the last good checkpoint is {root / 'step_000002'} (continue from it with "
                                    "train.resume=auto once there is room)"), message
        assert sorted(p.name for p in root.iterdir()) == ["step_000002"], run
        assert ckpt_tool(["verify", str(root / "step_000002")]) == 0


def _room_warnings(rank: int, world_size: int, tmp: str, free: int) -> list[str]:
    """Build a checkpointer for a model on a filesystem with ``free`` bytes; the warnings rank 0 logs."""
    import logging
    import shutil as sh
    from collections import namedtuple

    from ddptrain.checkpoint import Checkpointer
    from ddptrain.models import build_model, model_vocab_size

    usage = namedtuple("usage", "total used free")
    sh.disk_usage = lambda path: usage(free, 0, free)  # type: ignore[assignment]  # this forked rank only
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ddptrain").addHandler(handler)
    cfg = make_config(tmp, BASE)
    model = build_model(cfg.model, model_vocab_size(cfg.model, cfg.data.vocab_size), eos_id=0)
    Checkpointer(cfg, Path(tmp) / "run", "ddp").check_room(model)
    return [r for r in records if "may fail on a full disk" in r]


def test_start_up_warns_when_the_run_dir_lacks_room_for_keep_last_plus_one_checkpoints(tmp_path: Path) -> None:
    cramped, roomy = run_distributed(_room_warnings, 1, str(tmp_path), 10**6)[0], \
        run_distributed(_room_warnings, 1, str(tmp_path), 10**12)[0]
    assert roomy == []
    (warning,) = cramped
    assert warning.startswith(f"{tmp_path / 'run' / 'checkpoints'} has 1.0 MB free; checkpoint.keep_last=3 + 1 "
                              "checkpoints of about "), warning


def _train_when_rank1_cannot_write_its_rng_file(rank: int, world_size: int, tmp: str, run: str) -> list:
    real_save = torch.save

    def save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if rank == 1 and "step_000004" in str(path) and "rng" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(obj, path, *args, **kwargs)

    torch.save = save  # this forked rank only
    return _train_cases(rank, world_size, tmp, [(run, {})])


def test_one_ranks_full_disk_stops_every_rank_with_the_same_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ended = run_distributed(_train_when_rank1_cannot_write_its_rng_file, 2, str(tmp_path), str(run))
    assert ended[0] == ended[1] and ended[0][0] is not None, ended
    assert ended[0][0].startswith("checkpoint of step 4 failed: no space left in "), ended
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]


def test_verify_and_export_print_only_their_own_lines(
    tmp_path: Path, source: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No torch DCP warning that "torch.distributed is disabled" (the tool loads without a process group on
    purpose) and no transformers progress bars ("Writing model shards", "Loading weights") around the results."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as in a fresh ddptrain-ckpt process (a training run in this one turned them off)
    checkpoint = source / "checkpoints" / "step_000004"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt_tool(["verify", str(checkpoint)]) == 0
        assert ckpt_tool(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert err == ""
    assert out.splitlines() == [
        f"{checkpoint}: 81 tensors read; shapes match the model, all values finite",
        f"exported {checkpoint} to {tmp_path / 'out'}, read back and equal to the checkpoint (load it with "
        "AutoModelForCausalLM.from_pretrained)"]
