"""Where a replica group sits: its run subdirectory, its event file, and its ranks in the data-parallel job.

Every group writes under ``<run dir>/group<G>/`` (logs, metrics, summary, goodput, checkpoints): a group that dies
mid-save can only leave its own partial checkpoint, and every group keeps a complete one of its own, so
``train.resume=auto`` finds one in every group whichever died. The run dir itself holds what spans the groups:
``ft.json`` and the lighthouse's log (``ft/``).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from ddptrain.config.compose import Run
from ddptrain.config.schema import Config

GROUP_AGENT_ENV = "DDPTRAIN_FT_GROUP_AGENT"  # set in a group's agent by the local launcher, which announced the run
FT_DIR = "ft"  # <run dir>/ft/: the lighthouse's log and address, each group's events
FT_JSON = "ft.json"
QUORUM_LOST = "quorum_lost"  # a group's event when no quorum came in time: the launcher stops every group on it


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir / f"group{group}"


def in_group(run: Run) -> Run:
    """The run as replica group ``ft.replica_id`` sees it: its run dir is the group's own under the run's (the run
    itself unchanged without a group: the launcher of every group)."""
    group = run.typed.ft.replica_id
    if group is None:
        return run
    node = run.cfg.hydra.run
    OmegaConf.set_readonly(node, False)  # Hydra's node is read-only
    node.dir = str(group_dir(Path(os.path.abspath(node.dir)), group))
    OmegaConf.set_readonly(node, True)
    return run


def events_path(run_dir: Path, group: int) -> Path:
    """A group's event file (attempts, heals, steps), under the run dir (not the group's own)."""
    return run_dir / FT_DIR / f"group{group}.jsonl"


def run_dir_of_group(group_run_dir: Path) -> Path:
    """The run dir above a group's directory."""
    return group_run_dir.parent


def data_parallel_size(cfg: Config, group_world_size: int) -> int:
    """The data-parallel size the batch is split over: every rank of every group (R x N), or the job's ranks."""
    return group_world_size * max(cfg.ft.replica_groups, 1) if cfg.ft.replica_groups > 0 else group_world_size


def data_parallel_rank(cfg: Config, group_rank: int, group_world_size: int) -> int:
    """This rank's share of the global sample order: group G's rank r is G x N + r (the rank itself without groups)."""
    if cfg.ft.replica_groups > 0 and cfg.ft.replica_id is not None:
        return cfg.ft.replica_id * group_world_size + group_rank
    return group_rank
