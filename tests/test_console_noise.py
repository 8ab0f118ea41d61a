"""Other libraries' noise kept out of the user's console: what transformers, Optuna and the stop notice printed
around ddptrain's own lines (issue 50). The checkpoint tool's: tests/test_checkpoint_safety.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ddptrain.config.schema import ModelConfig
from ddptrain.models import build_model
from ddptrain.plan.memory.trace import pretrained_shape


@pytest.mark.parametrize("build", [build_model, pretrained_shape])
def test_a_gpt2_loss_does_not_warn_that_its_loss_type_is_unrecognized(build: object) -> None:
    """transformers finds a loss by the model's class name, and GPT2LMHeadModel names none: its first loss warned
    "`loss_type=None` was set in the config but it is unrecognized" (the dry run's first console line). The loss is
    still transformers' causal-LM loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.utils import logging as hf_logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library = logging.getLogger("transformers")
    verbosity = hf_logging.get_verbosity()
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  # transformers' once-per-process cache
    hf_logging.set_verbosity_warning()
    library.addHandler(handler)
    try:
        cfg = ModelConfig(arch="gpt2", hidden_size=32, num_layers=1, num_heads=2)  # type: ignore[arg-type]
        model = build(cfg, 64)  # type: ignore[operator]
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
    finally:
        library.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [r.getMessage() for r in records if "loss_type" in r.getMessage()] == []
    assert model.loss_function is ForCausalLMLoss
    assert torch.isfinite(loss)


def test_a_stop_signal_is_announced_once_by_rank_0_not_by_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C signals every process of the terminal's group: each rank's console used to print the notice, rank 1
    in its "[rank 1] WARNING ddptrain.step.control:" format. Each rank's console as ``setup_logging`` makes it."""
    import signal

    import torch.distributed as dist

    from ddptrain.step.control import StopRequest
    from ddptrain.telemetry import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    consoles = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    try:
        for rank in (0, 1):
            monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
            setup_logging(rank)
            stop = StopRequest(grace_s=1e6)  # its watchdog would end the process after the grace: never here
            try:
                signal.raise_signal(signal.SIGINT)
            finally:
                stop.restore()
            assert stop.signum == signal.SIGINT  # every rank still stops
            consoles[rank] = capsys.readouterr().err.splitlines()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert len(consoles[0]) == 1 and "SIGINT received" in consoles[0][0], consoles
    assert consoles[1] == [], consoles


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_an_offline_wandb_run_ends_naming_its_directory_and_the_sync_command(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """WANDB_MODE=offline needs no key; nothing is uploaded, so the run's last lines say where the W&B run is and
    how to upload it. A disabled W&B run has nothing to sync and says nothing."""
    from ddptrain.config.schema import WandbConfig
    from ddptrain.telemetry.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sink = WandbSink.open(WandbConfig(enabled=True), tmp_path, {"train": {"steps": 1}})
    assert sink is not None
    sink.log({"step": 1, "loss": 1.5})
    with caplog.at_level(logging.INFO, logger="ddptrain.telemetry.sinks"):
        sink.close()
    said = [r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage()]
    if mode == "disabled":
        assert said == []
        return
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))  # the run W&B wrote, which the line names
    assert said == [f"W&B run kept offline in {offline}; upload it with: wandb sync {offline}"]


@pytest.mark.parametrize(("workers", "noted"), [(8, True), (3, True), (2, False), (1, False)])
def test_more_local_workers_than_cores_gets_one_note(workers: int, noted: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch.nproc_per_node=8`` on 2 cores: each worker gets one thread and they take turns on the cores; the
    launcher prints this line before it starts them (app/launch.py)."""
    import os

    from ddptrain.runtime.topology import oversubscription_note

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    expected = (f"ddptrain: note: launch.nproc_per_node={workers} workers on 2 cores: each gets one thread and they "
                "take turns on the cores (launch.nproc_per_node=2 trains faster here)")
    assert oversubscription_note(workers) == (expected if noted else None)


@pytest.mark.parametrize(("cores", "workers", "busy", "threads"), [
    (2, 1, 0.0, 2), (2, 1, 0.4, 2),  # a quiet machine: torch's thread per core
    (2, 1, 6.0, 1), (2, 1, 12.0, 1), (2, 1, 1.0, 1),  # busy cores: 2 threads ran at 0.15x of 1 (load ~12)
    (16, 2, 0.0, 8), (16, 2, 8.0, 4), (16, 2, 40.0, 1), (2, 2, 0.0, 1), (2, 8, 0.0, 1),
])
def test_threads_per_worker_take_the_cores_the_machine_leaves_idle(
    cores: int, workers: int, busy: float, threads: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from ddptrain.runtime.topology import threads_per_worker

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert threads_per_worker(workers, busy=busy) == threads


def test_a_machine_whose_core_count_is_unknown_counts_as_one_core_and_busy_defaults_to_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ddptrain.runtime.topology import oversubscription_note, threads_per_worker

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads_per_worker(1) == 2  # no load given: a machine of our own, a thread per core
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # os.cpu_count() may not know
    assert threads_per_worker(1) == 1
    assert oversubscription_note(2) == (
        "ddptrain: note: launch.nproc_per_node=2 workers on 1 cores: each gets one thread and they take turns on "
        "the cores (launch.nproc_per_node=1 trains faster here)")
