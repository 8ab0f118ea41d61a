"""What one ``ddptrain`` invocation does: start workers through torch's elastic launcher, or be a worker."""

from __future__ import annotations

import copy
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from ddptrain.app.preflight import validate_config
from ddptrain.app.settled import SAID_BY_WORKER, clear_settled
from ddptrain.config.compose import Run
from ddptrain.config.schema import AUTO, Config
from ddptrain.data import BatchShape
from ddptrain.diagnose.evidence import Evidence
from ddptrain.diagnose.trace import DEFAULT_GROUP, current, group_of
from ddptrain.errors import ConfigError, PeerLost, ResourceError, RunEnded, one_line, say
from ddptrain.ft.layout import GROUP_AGENT_ENV, data_parallel_size, group_dir
from ddptrain.runtime.allocator import startup_line as allocator_line
from ddptrain.runtime.imports import imports_without_the_collector
from ddptrain.telemetry import setup_logging
from ddptrain.telemetry.goodput import LAUNCH_START_ENV, launcher_start
from ddptrain.telemetry.logs import elastic_records_to_run_log

if TYPE_CHECKING:
    import torch

    from ddptrain.runtime.process_group import DistEnv

# torch (and the runtime, which needs it) is imported in the functions that use it, after the config's checks: a
# config error, --help and --cfg answer without it (tests/test_startup.py holds what they import)

log = logging.getLogger("ddptrain")


def is_worker() -> bool:
    """True when an elastic agent (torchrun, or our own launch) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def dry_run(run: Run) -> int:
    """Print the plan (batch, memory per stage, communication, overlap) without devices or training."""
    from ddptrain.plan.analytic.render import render_plan
    from ddptrain.runtime.process_group import DistEnv

    typed = run.typed
    world_size = int(os.environ.get("WORLD_SIZE", typed.launch.nproc_per_node))
    if typed.plan.from_run:
        from ddptrain.plan.whatif import what_if

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


def operator_pod() -> bool:
    """True in a pod of a Kubernetes training operator that tells torchrun where the pod sits in the job
    (``PET_NNODES``: Kubeflow Trainer v2's torch-distributed runtime, Training Operator v1, or a JobSet manifest from
    ``ddptrain-k8s``)."""
    return "PET_NNODES" in os.environ and not is_worker()


def torchrun_options(nproc_per_node: int, max_restarts: int) -> tuple[list[str], int, int]:
    """torchrun's options for this machine, the job's world size and this node's process count (for the checks
    made before any worker starts).

    Alone: ``--standalone`` with ``launch.nproc_per_node`` workers. In an operator's pod: no option for what the
    operator set, since torchrun reads ``PET_<OPTION>`` as the default of each option (its documented contract
    with these operators); Training Operator v1 sets ``MASTER_ADDR``/``MASTER_PORT`` rather than
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, so those are passed on. The operator's process count wins over
    ``launch.nproc_per_node``.
    """
    if not operator_pod():
        options = ["--standalone", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
        return options, nproc_per_node, nproc_per_node
    from torch.distributed.run import determine_local_world_size

    env = os.environ
    options = []
    for option, fallback in (("master-addr", "MASTER_ADDR"), ("master-port", "MASTER_PORT")):
        if f"PET_{option.upper().replace('-', '_')}" not in env and fallback in env:
            options.append(f"--{option}={env[fallback]}")
    if "PET_NPROC_PER_NODE" not in env:
        options.append(f"--nproc-per-node={nproc_per_node}")
    if "PET_MAX_RESTARTS" not in env:
        options.append(f"--max-restarts={max_restarts}")
    nnodes = env["PET_NNODES"].split(":")[-1]  # an elastic job's MIN:MAX: checked at its largest
    try:  # auto, gpu, cpu or a number, as torchrun resolves it
        local = determine_local_world_size(env.get("PET_NPROC_PER_NODE", str(nproc_per_node)))
        world_size = int(nnodes) * local
    except ValueError as exc:
        raise ConfigError(f"PET_NNODES={env['PET_NNODES']}, PET_NPROC_PER_NODE={env.get('PET_NPROC_PER_NODE')}: "
                          "expected numbers of nodes and processes per node (set by the training operator)") from exc
    return options, world_size, local


def launch_workers(run: Run, argv: list[str]) -> int:
    """``launch.nproc_per_node`` workers on this machine through torch.distributed.run (torchrun's own code); in a
    training operator's pod, this node's share of the job, where the operator's ``PET_*`` variables say.

    The run directory is fixed here, once, so every worker and every restart writes to the same place.
    """
    typed = run.typed
    in_group = typed.ft.replica_id is not None  # one replica group's agent: it restarts this group alone
    restarts = typed.ft.group_restarts if in_group else typed.launch.max_restarts
    options, world_size, local = torchrun_options(typed.launch.nproc_per_node, restarts)
    shape = validate_config(typed, data_parallel_size(typed, world_size))  # fail here once, not in every worker
    run_dir = ready_run_dir(run, world_size, shape, f"starting {local} worker{'s' if local > 1 else ''}",
                            announce=GROUP_AGENT_ENV not in os.environ)  # the groups' launcher announced the run
    with imports_without_the_collector():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser
        from torch.distributed.run import run as elastic_run

        from ddptrain.diagnose.verdict import Failure, verdict
        from ddptrain.runtime.topology import oversubscription_note, threads_per_worker

    os.environ["DDPTRAIN_RUN_DIR"] = str(run_dir)
    elastic_records_to_run_log(run_dir)
    os.environ[LAUNCH_START_ENV] = launcher_start()  # goodput's wall-clock starts with this process
    # one share of the cores other jobs leave idle per worker: 2 threads on 2 busy cores ran 0.15x as fast as 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(local, busy=os.getloadavg()[0])))
    if (note := oversubscription_note(local)) is not None:
        say(note)
    if restarts > 0:
        # without it torchrun's agent did not restart gloo workers (torch 2.13), with or without --standalone
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args([*options, "-m", "ddptrain", *argv])
    saved_before = latest_commit(run_dir / typed.checkpoint.dir)
    started = time.time()  # evidence in <run dir>/hang/ from before is an earlier launch's (diagnose.verdict)
    try:
        try:
            elastic_run(args)
        finally:
            clear_settled(run_dir)  # a worker's settled exit code (``app/settled.py``) held for this launch only
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in SAID_BY_WORKER:  # the worker's own line was printed once: its code is the job's
            return failure.exitcode
        failures = [Failure(r, f.exitcode, f.signal_name() if f.exitcode < 0 else None)
                    for r, f in sorted(exc.failures.items(), key=lambda item: item[1].timestamp)]
        found = verdict(run_dir, failures, world_size, typed.dist.timeout_s, socket.gethostname(), since=started)
        if found is not None:  # the job's last line: who hung or died, and where (evidence in <run dir>/hang/)
            print(f"ddptrain: error: {found}", file=sys.stderr)
        elif GROUP_AGENT_ENV not in os.environ:  # a replica group's launcher names the failed group and its code
            print(f"ddptrain: worker rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return 1
    except SignalException as exc:
        if GROUP_AGENT_ENV in os.environ:  # a replica group's agent: the groups' launcher says why the run stopped
            return 128 + exc.sigval.value
        if latest_commit(run_dir / typed.checkpoint.dir) != saved_before:
            print(f"ddptrain: stopped by {exc.sigval.name}; workers were asked to checkpoint and exit "
                  f"(run dir {run_dir}; continue with train.resume=auto)", file=sys.stderr)
        elif exc.sigval != signal.SIGINT:  # on Ctrl-C rank 0's own line says what was interrupted
            print(f"ddptrain: stopped by {exc.sigval.name} before this launch committed a checkpoint (run dir "
                  f"{run_dir})", file=sys.stderr)
        return 128 + exc.sigval.value
    return 0


def ready_run_dir(run: Run, world_size: int, shape: BatchShape | None, doing: str, announce: bool = True,
                  replica_groups: int = 0) -> Path:
    """The run directory, once it is known the run can start there (``app/before_start.py``: nothing is written
    before), and the run's first console line (unless not ``announce``): where, how many ranks, the batch, and
    what comes next. ``replica_groups``: the groups' folders (``<run dir>/group<G>``, where each group keeps its
    checkpoints) are checked as well, once, here: each group's agent checks its own again, but only once the
    lighthouse and the other groups have started, and every group said the same refusal."""
    from ddptrain.app.before_start import check_before_start

    run_dir = Path(os.path.abspath(run.cfg.hydra.run.dir))  # resolved once: ${now:...} changes with the clock
    resume = check_before_start(run.typed, run_dir)
    for group in range(replica_groups):
        check_before_start(run.typed, group_dir(run_dir, group))
    batch = shape.equation() if shape is not None else "data.micro_batch_size=auto: chosen once the ranks meet"
    if announce:
        say(f"{time.strftime('%H:%M:%S')} run dir {run_dir} | {world_size} rank{'s' if world_size > 1 else ''} | "
            f"{batch} | {doing}")
    if resume is not None:  # the reads that need torch (seconds to import), after the line
        from ddptrain.checkpoint.before_start import check_resumable

        check_resumable(resume)
    return run_dir


def latest_commit(root: Path) -> tuple[str, int] | None:
    """The newest committed checkpoint under ``root`` and its marker's modification time (None: none)."""
    from ddptrain.checkpoint.format import MARKER

    markers = sorted(root.glob(f"step_*/{MARKER}")) if root.is_dir() else []
    return (str(markers[-1]), markers[-1].stat().st_mtime_ns) if markers else None


def run_worker(run: Run, device: torch.device | None = None) -> dict[str, Any]:
    """Train as one rank of the job (a job of one when nothing launched us); returns the run's summary.
    ``device``: the one a launcher assigned (Ray Train), else ``cuda:LOCAL_RANK`` or the CPU."""
    typed, resolved = run.typed, run.resolved
    # the batch shape, derived once here and handed to the trainer (None until data.micro_batch_size=auto is chosen)
    # as DistEnv reads it; before torch
    shape = validate_config(typed, data_parallel_size(typed, int(os.environ.get("WORLD_SIZE", "1"))))
    if not is_worker() and device is None:  # the whole job in this process: no launcher checked the run dir
        ready_run_dir(run, 1, shape, "starting")
    with imports_without_the_collector():
        setup_logging(int(os.environ.get("RANK", "0")))  # (it quiets transformers, so imports it)
        from ddptrain.runtime.process_group import distributed, shared_run_dir
        from ddptrain.runtime.topology import check_shared_run_dir
        from ddptrain.train.trainer import Trainer

    with distributed(typed.dist, cpu_collectives=typed.parallel.cpu_offload, device=device) as (env, device):
        if typed.data.micro_batch_size == AUTO:  # resolved once, to an int, before anything is built
            typed, resolved = agreed_micro_batch(run, env, device)
            shape = BatchShape.from_config(typed, data_parallel_size(typed, env.world_size))
        run_dir = shared_run_dir(run.cfg.hydra.run.dir)
        if env.num_nodes > 1:
            check_shared_run_dir(run_dir)
        setup_logging(env.rank, run_dir, console_info=not typed.ft.replica_id)  # group 0's lines, not each group's
        if device.type == "cuda" and (alloc := allocator_line(os.environ)) is not None:
            log.info("%s", alloc)  # ddptrain's expandable segments, or the user's own
        evidence = Evidence(run_dir, env.rank)
        try:
            trainer = Trainer(typed, env, device, run_dir, resolved, shape)
            if env.is_main:  # once the run is known to start (its checkpoint resumed): never over a refused one's
                (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
            summary = trainer.train()
        except RuntimeError as exc:  # torch.distributed's errors (DistError) are RuntimeErrors
            if (record := evidence.lost_peer(exc)) is None:
                raise
            raise PeerLost(lost_peer_line(record, typed.dist.timeout_s, run_dir)) from exc
        except (ConfigError, ResourceError, RunEnded, KeyboardInterrupt):  # refused, or ended on purpose: no hang
            evidence.discard()
            raise
        evidence.discard()  # a healthy run leaves no hang/ (it records nothing unless a rank hangs or dies)
    return summary


def agreed_micro_batch(run: Run, env: DistEnv, device: torch.device) -> tuple[Config, dict[str, Any]]:
    """``data.micro_batch_size=auto`` resolved, before the model is built and the data batched: the typed config
    and the resolved dict (the run dir's config.yaml) with the micro batch chosen.

    Every rank traces the same plan for its own device (fake tensors: deterministic, the same config on every
    rank), and all take the smallest choice (one all-reduce): every rank then agrees, and the chosen micro batch
    fits the smallest device, even where ranks' memories differ. A rank whose device cannot fit even one sequence
    reports 0, and every rank stops with a line (that rank's names what would fit)."""
    import torch

    from ddptrain.models.build import model_vocab_size
    from ddptrain.plan.memory.auto_batch import choose_micro_batch, with_micro_batch
    from ddptrain.plan.memory.overheads import RunOverheads
    from ddptrain.plan.memory.present import this_device, with_memory

    typed = run.typed
    # the rank's own device as it is now (its memory less what is in use), unless plan.device_memory_gib says
    target = with_memory(this_device(device), typed.plan.device_memory_gib)
    overheads = RunOverheads.of(typed, env.local_world_size, os.environ)
    line = ""
    try:
        chosen = choose_micro_batch(typed, env.world_size, target, model_vocab_size(typed.model, typed.data.vocab_size),
                                    overheads=overheads)
        micro, line = chosen.micro_batch, chosen.line()
    except ConfigError as exc:
        micro, line = 0, str(exc)
    except Exception as exc:  # noqa: BLE001  # the peers must not wait on a rank whose trace failed
        micro, line = 0, f"data.micro_batch_size=auto: the traced plan failed ({type(exc).__name__}: {one_line(exc)})"
    agreed = micro
    if env.world_size > 1:
        smallest = torch.tensor([micro], device=device)
        torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
        agreed = int(smallest.item())
    if agreed == 0:
        raise ConfigError(line if micro == 0 else "data.micro_batch_size=auto: another rank cannot fit micro batch 1 "
                          "(its line says what would)")
    if agreed != micro:
        line = f"data.micro_batch_size=auto: micro batch {agreed}, the smallest any rank's device fits (here: {line})"
    log.info("%s", line)
    resolved = copy.deepcopy(run.resolved)
    resolved["data"]["micro_batch_size"], resolved["data"]["grad_accum"] = agreed, None
    return with_micro_batch(typed, agreed), resolved


def lost_peer_line(record: dict[str, Any], timeout_s: float, run_dir: Path) -> str:
    """This rank's own line after a collective timed out: what it waited in; the launcher names the late rank."""
    waited = current(record["collectives"])
    what = f"{waited['op'] or 'collective'} #{waited['seq']}" if waited else "a collective"
    if waited and group_of(waited) != DEFAULT_GROUP:
        what += f" of group {record['groups'].get(group_of(waited), {}).get('desc') or group_of(waited)}"
    return (f"rank {record['rank']} stopped waiting in {what} at step {record['step']} ({record['phase']}) after "
            f"at most {timeout_s:g} s (dist.timeout_s): a peer never came or left; evidence in {run_dir / 'hang'}")
