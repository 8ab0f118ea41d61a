"""The end-of-run export: rank 0 merges and saves alone while the other ranks wait on the store, which no
collective timeout (``dist.timeout_s``) ends; rank 0's error and a wait past ``checkpoint.export_timeout_s`` end
every rank's wait with one line."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddptrain.checkpoint.checkpointer import Checkpointer
from ddptrain.errors import ConfigError
from ddptrain.runtime.process_group import main_only
from tests.helpers.dist import run_distributed
from tests.helpers.runs import make_config

COLLECTIVE_TIMEOUT_S = 0.75
SLOW_SAVE_S = 2.1  # rank 0's save: longer than two collective timeouts (with the margin the test allows)
EXPORT_WAIT_S = 0.2  # rank 1's wait for a late export; rank 0's export ends only once rank 1 has given up


class SlowToSave(torch.nn.Linear):
    """The unsharded copy rank 0 exports, as slow to save as a model of billions of parameters."""

    def save_pretrained(self, path: str) -> None:
        time.sleep(SLOW_SAVE_S)
        Path(path).mkdir(parents=True)
        torch.save(self.state_dict(), Path(path) / "weights.pt")


def _outcome(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result under test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _meet(store: dist.Store, name: str, world_size: int) -> None:
    """Every rank here, through the store alone: no collective left in flight when a group is destroyed."""
    store.add(name, 1)
    while store.add(name, 0) < world_size:
        time.sleep(0.01)


def export_with_a_short_collective_timeout(rank: int, world_size: int, tmp: str) -> dict[str, object]:
    """For ``run_distributed``: a fresh gloo group whose collectives time out after ``COLLECTIVE_TIMEOUT_S``."""
    _meet(dist.distributed_c10d._get_default_store(), "ddptrain-test/initialized", world_size)
    dist.destroy_process_group()
    store = dist.FileStore(str(Path(tmp) / "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    checkpointer = Checkpointer(make_config(tmp), Path(tmp) / "run", "none")
    model = torch.nn.Linear(4, 3)
    start = time.monotonic()
    exported = _outcome(lambda: checkpointer.export(model, Path(tmp), lambda: SlowToSave(4, 3)))
    waited = time.monotonic() - start
    saved = (Path(tmp) / "model" / "weights.pt").is_file()
    works = _outcome(dist.barrier)  # the group outlived the export

    def fail() -> None:
        raise OSError("No space left on device")

    failed = _outcome(lambda: main_only(fail, 60, "checkpoint.export_timeout_s", "exporting the model"))
    gave_up = "rank 1 gave up"  # rank 0 exports until rank 1 has given up waiting: late whatever the load

    late = _outcome(lambda: main_only(lambda: store.wait([gave_up], timedelta(seconds=60)), EXPORT_WAIT_S,
                                      "checkpoint.export_timeout_s", "exporting the model"))
    if rank == 1:
        store.set(gave_up, "")
    _meet(store, "finished", world_size)
    return {"exported": exported, "waited": waited, "saved": saved, "works": works, "failed": failed, "late": late}


def test_other_ranks_wait_out_a_slow_export_on_the_store_not_in_a_collective(tmp_path: Path) -> None:
    ranks = run_distributed(export_with_a_short_collective_timeout, 2, str(tmp_path))
    assert [r["exported"] for r in ranks] == ["ok", "ok"], "a collective timed out during the export"
    assert [r["works"] for r in ranks] == ["ok", "ok"]
    # rank 1 waited out rank 0's whole save, which outlasts two collective timeouts (it starts its clock a little
    # after rank 0 starts sleeping, hence the margin)
    assert ranks[1]["saved"] and ranks[1]["waited"] >= SLOW_SAVE_S - 0.5 > 2 * COLLECTIVE_TIMEOUT_S
    assert ranks[0]["failed"] == "OSError: No space left on device"
    assert ranks[1]["failed"] == ("RuntimeError: rank 0 failed while exporting the model: "
                                  "OSError: No space left on device")
    assert ranks[0]["late"] == "ok"
    assert ranks[1]["late"] == ("ConfigError: checkpoint.export_timeout_s=0.2: rank 1 waited that long for rank 0, "
                                "exporting the model; raise it")


def test_the_export_wait_is_a_positive_number_of_seconds() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.export_timeout_s=0.0: expected a positive number"):
        make_config("unused", {"checkpoint": {"export_timeout_s": 0}})
