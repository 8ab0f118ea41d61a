"""Ctrl-C outside the training loop (preparing the data, building the model): one line, from rank 0, within
seconds. The command end to end, slow tier: ``tests/test_cli.py`` (``test_ctrl_c_while_preparing_the_data_...``)."""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
from torch.distributed import TCPStore

from ddptrain.app.cli import run_cli
from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import _await_main


def test_a_rank_waiting_for_rank_0s_data_sees_ctrl_c_within_a_second() -> None:
    """The other ranks wait for rank 0's data on the store; a native wait would hold a Ctrl-C until it returned
    (data.prepare_timeout_s, 30 minutes by default), and rank 0's exit would find them in no barrier."""
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))

    def interrupt(*_: Any) -> NoReturn:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _await_main(store, "never-set", 8.0, "timed out")
        assert time.monotonic() - start < 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(("rank", "said"), [("0", True), ("1", False)])
def test_ctrl_c_outside_the_loop_is_one_line_from_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: str, said: bool
) -> None:
    from ddptrain.app import launch
    from ddptrain.runtime.starting import INTACT_CACHE, starting

    def interrupted(*_: Any, **__: Any) -> None:
        with starting("preparing the data", safe=INTACT_CACHE):
            raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setattr(launch, "run_worker", interrupted)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's own handlers
    assert run_cli(["data=synthetic"]) == 130
    # ddptrain's own lines: a console log handler an earlier test in this process left on the root logger may add
    # the phase's INFO line ("preparing the data ..."), which a run's own console shows before the interrupt too
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("ddptrain")]
    assert err == ([f"ddptrain: interrupted (SIGINT) while preparing the data; {INTACT_CACHE}"] if said else []), err
    assert "checkpoint" not in INTACT_CACHE


def test_a_rank_waiting_for_rank_0s_data_gives_up_at_its_timeout_in_seconds() -> None:
    """The polled wait keeps data.prepare_timeout_s's unit: 0.5 means half a second, then the timeout's line."""
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"^rank 0 took too long$"):
        _await_main(store, "never-set", 0.5, "rank 0 took too long")
    assert 0.5 <= time.monotonic() - start < 5


def test_a_tokenizer_pool_worker_leaves_ctrl_c_to_the_preparing_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C reaches the whole process group: a pool worker ignores it (the preparing process stops the pool);
    the preparing process's own encoder (not in a pool) keeps it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from ddptrain.data import encode

    handlers: list[tuple[int, Any]] = []
    monkeypatch.setattr(encode.signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # restored after the test
    monkeypatch.setattr(encode, "_WORKER", {})
    tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    encode.start_worker(tokenizer, 0, in_pool=False)
    assert handlers == []
    encode.start_worker(tokenizer, 0)
    assert handlers == [(signal.SIGINT, signal.SIG_IGN)]


def test_a_waiting_rank_looks_for_rank_0s_key_every_fifth_of_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll period bounds how late a waiting rank sees rank 0's key (and a Ctrl-C): the store's key appears at
    the third look, after two sleeps of 0.2 s (``time.sleep`` recorded, not slept)."""
    looks: list[list[str]] = []

    class Store:
        def check(self, keys: list[str]) -> bool:
            looks.append(keys)
            return len(looks) == 3

        def get(self, key: str) -> bytes:
            return b"done"

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    _await_main(Store(), "rank0/data", 60.0, "timed out")  # type: ignore[arg-type]
    assert looks == [["rank0/data"]] * 3 and slept == [0.2, 0.2]


def test_a_rank_that_stopped_waiting_names_the_collective_its_group_and_where_it_was(tmp_path: Path) -> None:
    """After a collective timed out, the rank's own line names what it waited in: the op and number, and the group
    (by its description) when it is not the default group; a rank with no collective recorded says so."""
    from ddptrain.app.launch import lost_peer_line

    record = {"rank": 3, "step": 12, "phase": "backward", "groups": {"2": {"desc": "replicate"}},
              "collectives": [{"group": "0", "seq": 40, "op": "all_reduce", "completed": True},
                              {"group": "2", "seq": 7, "op": "all_gather", "completed": False}]}
    assert lost_peer_line(record, 60.0, tmp_path) == (
        f"rank 3 stopped waiting in all_gather #7 of group replicate at step 12 (backward) after at most 60 s "
        f"(dist.timeout_s): a peer never came or left; evidence in {tmp_path / 'hang'}")
    record["collectives"] = [{"group": "0", "seq": 41, "op": "", "completed": False}]
    assert lost_peer_line(record, 1.5, tmp_path).startswith("rank 3 stopped waiting in collective #41 at step 12")
    record["collectives"] = []
    assert "stopped waiting in a collective at step 12" in lost_peer_line(record, 1.5, tmp_path)
