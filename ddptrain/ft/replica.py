"""The worker's side of a run with replica groups: one torchft ``Manager`` per rank, and what it does each step.

Each step (``begin``) asks the lighthouse for a quorum, synchronously (``use_async_quorum=False``): a group whose
step is behind the quorum's (it came back from a restart) copies a peer's live state before its forward pass (the
heal, torchft's checkpoint transport over the groups' process group) and jumps to the peers' step.
``average`` sums the gradients (already averaged inside the group by torch DDP) over the groups in the quorum and
divides by their number — the loss rides in the same buffer, so every group logs the mean over the whole job.
``commit`` is torchft's ``should_commit``: every rank of a group gets the same answer, and a step not committed is
not applied (the update, the learning rate's step and the data position are all rolled back) and is taken again.

The state a peer sends: the model, the optimizer, the learning-rate schedule, the fp16 loss scaler and the data
position. The data position is global (the same on every rank: samples of the global order consumed), so copying
it from a peer of any rank puts this rank exactly where the step count says.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch

from ddptrain.config.choices import FtSync
from ddptrain.config.schema import Config
from ddptrain.errors import QuorumLost
from ddptrain.ft.accounting import size_runs, write_ft_json
from ddptrain.ft.diloco import OuterSync, outer_sync_summary
from ddptrain.ft.layout import QUORUM_LOST, events_path, run_dir_of_group
from ddptrain.runtime.process_group import DistEnv

log = logging.getLogger("ddptrain")

FR_DUMP_ENV = "TORCH_FR_DUMP_TEMP_FILE"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class NoReplicas:
    """A run without replica groups: every step is the next, nothing is averaged across groups, all commit."""

    heal_seconds = 0.0

    def begin(self, step: int) -> int:
        return step

    def average(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def commit(self, step: int) -> bool:
        return True

    def updated(self, step: int) -> None:
        pass

    def window(self) -> dict[str, Any]:
        return {}

    def summarize(self, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def stateful(self) -> dict[str, Stateful]:
        return {}

    def resumed(self, start: int) -> None:
        pass

    def close(self) -> None:
        pass


def replicas_for(cfg: Config, env: DistEnv, group_run_dir: Path, parts: Mapping[str, Stateful]
                 ) -> NoReplicas | ReplicaGroup:
    """This rank's cross-group side: a ``ReplicaGroup`` in a run with replica groups, else nothing to do. Built
    before the checkpoint is resumed (``resumed`` then gives it the step): under DiLoCo its outer state is one of
    the checkpoint's parts."""
    if cfg.ft.replica_groups == 0 or cfg.ft.replica_id is None:
        return NoReplicas()
    return ReplicaGroup(cfg, env, group_run_dir, parts)


class ReplicaGroup:
    """This rank in replica group ``ft.replica_id``: its Manager, the quorum sizes, its events (group rank 0)."""

    def __init__(self, cfg: Config, env: DistEnv, group_run_dir: Path, parts: Mapping[str, Stateful]) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        self.cfg, self.env, self.parts = cfg, env, parts
        self.group = int(cfg.ft.replica_id or 0)
        self.heal_seconds = 0.0  # the last begin()'s heal (0: none)
        self._data_before: Any = None
        self._synced = 0  # DiLoCo: the outer syncs recorded so far
        self._cross_bytes = 0  # the last step's gradient payload averaged across groups (ft.sync=ddp)
        self._quorums: list[int] = []  # this window's quorum sizes
        self._sizes: dict[int, int] = {}  # each recorded step's quorum size, for the summary
        self._events = events_path(run_dir_of_group(group_run_dir), self.group) if env.rank == 0 else None
        if self._events is not None:
            self._events.parent.mkdir(parents=True, exist_ok=True)
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        # torchft re-points NCCL's flight-recorder dump (ddptrain's hang evidence, runtime/process_group.py) into a
        # folder per quorum, made at every quorum: left as ddptrain set it, the evidence stays where the verdict
        # reads it and a healthy run leaves no hang/
        dump = os.environ.pop(FR_DUMP_ENV, None)
        # a heal reads the peer's tensors from read-only buffers (torch warns once per process; they are copied)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        # ... and torchft's transport uses a pytree API torch deprecates (a warning per heal)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, min_replica_size=cfg.ft.min_replicas,
            # the heal's copy goes through the groups' own process group (torchft's HTTP transport, the default,
            # prints a request line on the console for every copy)
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
            load_state_dict=self._load, state_dict=self._state, use_async_quorum=False,
            replica_id=f"ddptrain_group{self.group}", lighthouse_addr=cfg.ft.lighthouse,
            rank=env.rank, world_size=env.world_size,  # the group's own ranks; the store torchrun's rank 0 hosts
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.ft.quorum_timeout_s),
            init_sync=False,  # every group built the same weights from train.seed: nothing to copy at step 0
        )
        if dump is not None:
            os.environ[FR_DUMP_ENV] = dump
        # DiLoCo (ft.sync=diloco|streaming_diloco): no per-step quorum or average; the groups meet every
        # ft.sync_every inner steps, inside the optimizer's step (its hooks), through torchft's own DiLoCo. No
        # fragment's all-reduce is left in flight across a step (sync_delay 0): every step can be checkpointed.
        self.outer: OuterSync | None = None
        if cfg.ft.sync != FtSync.ddp:
            self.outer = OuterSync.build(self.manager, parts["model"], parts["optimizer"], cfg.ft, sync_delay=0)
            self.outer.__enter__()

    def stateful(self) -> dict[str, Stateful]:
        """What this side adds to the checkpoint: DiLoCo's outer state (window starts, outer momentum, position)."""
        return {"outer_sync": self.outer} if self.outer is not None else {}

    def resumed(self, start: int) -> None:
        """The step the run continues after (a resumed checkpoint's, else 0): the manager's count continues from
        it, and a group behind the quorum's heals. Under DiLoCo the manager counts the outer syncs, not the steps:
        its count is the checkpoint's outer state's (loaded with it; 0 in a fresh run), left as it is."""
        if self.outer is None:
            self.manager.load_state_dict({"step": start, "batches_committed": 0})
        self._event({"event": "attempt", "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     "resumed_from": start, "time": time.time()})

    def _state(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def _load(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state[name])

    def begin(self, step: int) -> int:
        """The quorum for the next step (``step`` as this group counts): the step it really is, the peers' when
        this group healed (``heal_seconds`` then says how long the copy took)."""
        if self.outer is not None:  # DiLoCo: the quorum comes at the window's sync, inside the optimizer's step
            self.heal_seconds = 0.0
            return step
        started = time.monotonic()
        before = self.manager.current_step()
        self._data_before = self.parts["data"].state_dict()
        try:
            self.manager.start_quorum()
        except Exception as exc:  # the lighthouse's answer never came: no quorum of ft.min_replicas in time
            self._event({"event": QUORUM_LOST, "step": step, "time": time.time()})
            raise QuorumLost(f"replica group {self.group}: no quorum of ft.min_replicas={self.cfg.ft.min_replicas} "
                           f"groups within ft.quorum_timeout_s={self.cfg.ft.quorum_timeout_s:g} (lighthouse "
                           f"{self.cfg.ft.lighthouse}: {type(exc).__name__}); stopping", 1) from exc
        now = self.manager.current_step()
        self.heal_seconds = 0.0
        if now != before:  # healed: the state (and the data position with it) is the peers' after step `now`
            self.heal_seconds = time.monotonic() - started
            self._data_before = self.parts["data"].state_dict()
            log.warning("replica group %d healed from a peer: step %d -> %d in %.2f s", self.group, before, now,
                     self.heal_seconds)
            self._event({"event": "heal", "step": now + 1, "seconds": round(self.heal_seconds, 3)})
        return now + 1

    def average(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """The gradients of ``model``'s parameters averaged over the quorum's groups, in place, in one all-reduce
        that also carries the loss; returns the loss averaged likewise. Under DiLoCo nothing: the groups train apart
        within a window (the loss logged is the group's own)."""
        if self.outer is not None:
            return loss
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tail = loss.detach().reshape(1).to(grads[0].dtype if grads else loss.dtype)
        flat = torch.cat([*(g.reshape(-1) for g in grads), tail])
        self._cross_bytes = (flat.numel() - 1) * flat.element_size()  # the gradients' payload (one dtype: cat)
        self.manager.allreduce(flat).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return flat[-1].to(loss.dtype)

    def commit(self, step: int) -> bool:
        """torchft's verdict on this step, the same on every rank of the group; a step not committed gives the
        data it drew back. Records the step and its quorum size."""
        if self.outer is not None:  # an inner step is this group's own: always kept (see ``updated``)
            return True
        quorum = self.manager.num_participants()
        committed = bool(self.manager.should_commit())
        if not committed:
            self.parts["data"].load_state_dict(self._data_before)
            log.warning("replica group %d: step %d not committed (a peer failed in it): taken again", self.group, step)
        else:
            self._quorums.append(quorum)
            self._sizes[step] = quorum
        self._event({"event": "step", "step": step, "quorum": quorum, "committed": committed})
        return committed

    def updated(self, step: int) -> None:
        """After step ``step``'s update. DiLoCo: the groups met only if the step closed a window (its sync ran in
        the optimizer's step), and only then is there a quorum to record. Nothing to do under ft.sync=ddp."""
        if self.outer is None:
            return
        quorum = None
        if len(self.outer.records) > self._synced:
            self._synced = len(self.outer.records)
            quorum = self.manager.num_participants()
            self._quorums.append(quorum)
            self._sizes[step] = quorum
        self._event({"event": "step", "step": step, "quorum": quorum, "committed": True})

    def window(self) -> dict[str, Any]:
        """The window's quorum sizes (the metrics record): the smallest and the mean."""
        sizes, self._quorums = self._quorums, []
        return {"ft_quorum_min": min(sizes), "ft_quorum_mean": sum(sizes) / len(sizes)} if sizes else {}

    def summarize(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` (summary.json's) with this group's ``ft`` entry, and ``comm_bytes`` counting the sync across
        groups beside the one inside the group (a group of one rank has none of its own)."""
        ft = self.summary()
        return record | ft | {"comm_bytes": (record.get("comm_bytes") or 0.0) + ft["ft"]["cross_group_bytes"]}

    def summary(self) -> dict[str, Any]:
        """For summary.json: this group and each committed step's quorum size, as [first, last, size] runs, and the
        payload bytes per step and rank the groups' sync moves (``cross_group_bytes``): every step's gradients
        under ft.sync=ddp, the outer sync's over ft.sync_every under DiLoCo (with its counters)."""
        ft: dict[str, Any] = {"replica_groups": self.cfg.ft.replica_groups, "replica_id": self.group,
                              "sync": str(self.cfg.ft.sync), "quorum_per_step": size_runs(self._sizes)}
        if self.outer is not None:
            ft.update(outer_sync_summary(self.outer))
            ft["cross_group_bytes"] = ft.pop("comm_bytes")
        else:
            ft["cross_group_bytes"] = float(self._cross_bytes)
        return {"ft": ft}

    def _event(self, record: dict[str, Any]) -> None:
        if self._events is not None:
            with self._events.open("a") as out:
                out.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Shut the Manager down; group rank 0 writes ``ft.json`` as far as the groups' events go (on a cluster no
        local launcher writes it at the end)."""
        if self.outer is not None:
            self.outer.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self._events is not None:
            write_ft_json(self._events.parent.parent, self.cfg.ft.replica_groups)
