"""What one ``ddptrain`` invocation does: start workers through torch's elastic launcher, or be a worker."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddptrain.config.checks import validate_config
from ddptrain.config.compose import build_config, job_config
from ddptrain.config.schema import Config
from ddptrain.diagnose.evidence import Evidence
from ddptrain.errors import ConfigError, PeerLost, one_line
from ddptrain.runtime.process_group import DistEnv, distributed, shared_run_dir
from ddptrain.runtime.topology import check_shared_run_dir
from ddptrain.telemetry import setup_logging
from ddptrain.telemetry.goodput import LAUNCH_START_ENV, launcher_start

log = logging.getLogger("ddptrain")


def is_worker() -> bool:
    """True when an elastic agent (torchrun, or our own launch) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


@dataclass(frozen=True)
class Run:
    """One composed run: the config with Hydra's node, the same as the schema's dataclasses, and as a plain
    resolved dict (for W&B and the run dir). Resolved once, here."""

    cfg: DictConfig
    typed: Config
    resolved: dict[str, Any]


def typed_config(cfg: DictConfig) -> Run:
    """Resolve and type the job config once; a bad interpolation or a failed schema check is bad input."""
    job = job_config(cfg)
    try:
        resolved = OmegaConf.to_container(job, resolve=True, throw_on_missing=True, enum_to_str=True)
        typed = build_config(resolved)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(one_line(exc)) from exc
    assert isinstance(resolved, dict)
    # the checkpointing mode in effect, also when the deprecated model.gradient_checkpointing chose it
    resolved["model"]["activation_checkpointing"] = str(typed.model.activation_checkpointing)
    return Run(cfg, typed, resolved)


def dry_run(run: Run) -> int:
    """Print the plan (batch, memory per stage, communication, overlap) without devices or training."""
    from ddptrain.plan.planner_render import render_plan

    typed = run.typed
    world_size = int(os.environ.get("WORLD_SIZE", typed.launch.nproc_per_node))
    if typed.plan.from_run:
        from ddptrain.plan import what_if

        if DistEnv.from_environ().is_main:
            print(what_if(typed.plan, world_size))
        return 0
    if not DistEnv.from_environ().is_main:
        return 0
    from ddptrain.plan.dry_run import plan_for_target

    plan, text, record = plan_for_target(typed, world_size)
    print(render_plan(plan))
    if text:
        print(text)
    write_plan_json(run, record)
    return 0


def write_plan_json(run: Run, record: dict) -> None:
    """``<run dir>/plan.json``: what the dry run printed, as numbers."""
    import json
    from pathlib import Path

    run_dir = Path(run.cfg.hydra.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(record, indent=1))


def launch_workers(run: Run, argv: list[str]) -> int:
    """``launch.nproc_per_node`` workers on this machine through torch.distributed.run (torchrun's own code).

    The run directory is fixed here, once, so every worker and every restart writes to the same place.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    from ddptrain.diagnose.verdict import Failure, verdict

    typed = run.typed
    validate_config(typed, typed.launch.nproc_per_node)  # fail here once, not in every worker
    os.environ["DDPTRAIN_RUN_DIR"] = os.path.abspath(run.cfg.hydra.run.dir)
    os.environ[LAUNCH_START_ENV] = launcher_start()  # goodput's wall-clock starts with this process
    threads = max(1, (os.cpu_count() or 1) // typed.launch.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # one share of the cores per worker
    if typed.launch.max_restarts > 0:
        # without it torchrun's agent did not restart gloo workers (torch 2.13), with or without --standalone
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={typed.launch.nproc_per_node}",
         f"--max-restarts={typed.launch.max_restarts}", "-m", "ddptrain", *argv]
    )
    try:
        elastic_run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        failures = [Failure(r, f.exitcode, f.signal_name() if f.exitcode < 0 else None)
                    for r, f in sorted(exc.failures.items(), key=lambda item: item[1].timestamp)]
        found = verdict(Path(os.environ["DDPTRAIN_RUN_DIR"]), failures, typed.launch.nproc_per_node,
                        typed.dist.timeout_s, socket.gethostname())
        if found is not None:  # the job's last line: who hung or died, and where (evidence in <run dir>/hang/)
            print(f"ddptrain: error: {found}", file=sys.stderr)
        else:
            print(f"ddptrain: worker rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"ddptrain: stopped by {exc.sigval.name}; workers were asked to checkpoint and exit "
              f"(run dir {os.environ['DDPTRAIN_RUN_DIR']}; continue with train.resume=auto)", file=sys.stderr)
        return 128 + exc.sigval.value
    return 0


def run_worker(run: Run) -> int:
    """Train as one rank of the job (a job of one when nothing launched us)."""
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    typed, resolved = run.typed, run.resolved
    validate_config(typed, env.world_size)
    from ddptrain.train import train

    with distributed(typed.dist, cpu_collectives=typed.parallel.cpu_offload) as (env, device):
        run_dir = shared_run_dir(run.cfg.hydra.run.dir)
        if env.num_nodes > 1:
            check_shared_run_dir(run_dir)
        setup_logging(env.rank, run_dir)
        evidence = Evidence(run_dir, env.rank)
        if env.is_main:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        try:
            train(typed, env, device, run_dir, resolved)
        except RuntimeError as exc:  # torch.distributed's errors (DistError) are RuntimeErrors
            if (record := evidence.lost_peer(exc)) is None:
                raise
            raise PeerLost(lost_peer_line(record, typed.dist.timeout_s, run_dir)) from exc
    return 0


def lost_peer_line(record: dict[str, Any], timeout_s: float, run_dir: Path) -> str:
    """This rank's own line after a collective timed out: what it waited in; the launcher names the late rank."""
    last = record["collectives"][-1] if record["collectives"] else None
    what = f"{last['op']} #{last['seq']}" if last else "a collective"
    return (f"rank {record['rank']} stopped waiting in {what} at step {record['step']} ({record['phase']}) after "
            f"at most {timeout_s:g} s (dist.timeout_s): a peer never came or left; evidence in {run_dir / 'hang'}")
