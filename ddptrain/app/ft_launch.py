"""The local launch of a run with replica groups (``ft.replica_groups``, torchft): a lighthouse and one elastic
agent per group.

``ddptrain … ft.replica_groups=R launch.nproc_per_node=N`` checks the config and the run dir once (as the plain
launch does), starts the lighthouse (unless ``ft.lighthouse`` names one), then R agents, each ``ddptrain`` itself
with ``ft.replica_id=G``: torch's elastic launcher with its own rendezvous (``--standalone``) and
``--max-restarts=ft.group_restarts`` (``app/launch.py``), so a group whose worker dies is restarted by its own agent
while the others keep stepping. Every group writes under ``<run dir>/group<G>/`` (``ft/layout.py``); when the run
stops as a whole is ``ft/supervise.py``'s.

Ctrl-C and SIGTERM reach every agent. The exit code: 0 when every group finished (or one did and the late ones were
stopped); a worker's own code when it printed its line (``SAID_BY_WORKER``); 1 otherwise; 128 + the signal when
stopped by one. A last line that every group's workers say alike (a refusal they find after starting) is said
once, by the first group (``app/said.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

from ddptrain.app.launch import ready_run_dir
from ddptrain.app.preflight import validate_config
from ddptrain.app.said import SAID_DIR_ENV, fresh_said_dir
from ddptrain.app.settled import SAID_BY_WORKER
from ddptrain.config.compose import Run
from ddptrain.errors import say
from ddptrain.ft.accounting import write_ft_json
from ddptrain.ft.layout import FT_DIR, GROUP_AGENT_ENV, group_dir
from ddptrain.ft.lighthouse import Lighthouse
from ddptrain.ft.supervise import GroupEvents, finished_first, group_argv, kill, publish_summary, watch
from ddptrain.telemetry.goodput import LAUNCH_START_ENV, launcher_start


def launch_groups(run: Run, argv: list[str]) -> int:
    """Start the lighthouse and the R group agents; wait for them (the module's docstring)."""
    typed = run.typed
    groups, per_group = typed.ft.replica_groups, typed.launch.nproc_per_node
    world = groups * per_group
    shape = validate_config(typed, world)
    run_dir = ready_run_dir(run, world, shape, f"starting {groups} replica groups of {per_group} worker"
                            f"{'s' if per_group > 1 else ''} (torchft)", replica_groups=groups)
    lighthouse = Lighthouse(run_dir, typed.ft.min_replicas) if typed.ft.lighthouse is None else None
    address = lighthouse.start().address if lighthouse is not None else str(typed.ft.lighthouse)
    env = {**os.environ, GROUP_AGENT_ENV: "1", LAUNCH_START_ENV: launcher_start(),
           "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at info
           # a refusal every group finds alike is said by the first group only (app/said.py)
           SAID_DIR_ENV: str(fresh_said_dir(run_dir / FT_DIR / "said"))}
    agents: list[subprocess.Popen[bytes]] = []
    stopped_by: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopped_by.append(signum)
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    # before any group of this launch writes a line: what its groups leave is told from what earlier launches left
    events, started = GroupEvents.of_this_launch(run_dir, groups), time.time()
    try:
        for g in range(groups):
            group_dir(run_dir, g).mkdir(parents=True, exist_ok=True)
            agents.append(subprocess.Popen([sys.executable, "-m", "ddptrain", *group_argv(argv, run_dir, g, address)],
                                           env=env, start_new_session=True))  # its own session: a kill ends it all
        ended = watch(agents, lighthouse, events)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for agent in agents:
            if agent.poll() is None:
                kill(agent)
        if lighthouse is not None:
            lighthouse.stop()
        record = write_ft_json(run_dir, groups)
        publish_summary(run_dir, groups, record, since=started)
    if ended is not None:
        say(f"ddptrain: error: {ended}; the last checkpoints are kept in {run_dir}/group*/ (continue with "
            "train.resume=auto)")
        return 1
    if stopped_by:
        return 128 + stopped_by[0]
    codes = [agent.returncode for agent in agents]
    if all(code == 0 for code in codes) or (0 in codes and finished_first(run_dir, groups, since=started)):
        # a group that failed on its own (its restarts spent; its agent says nothing) while others trained every
        # step: the run succeeded, and the group is named. A group stopped late (SIGTERM, a kill) exited >= 128 or
        # < 0, and watch() named it.
        for g, code in enumerate(codes):
            if 0 < code < 128:
                say(f"ddptrain: note: replica group {g} failed (exit code {code}) after ft.group_restarts="
                    f"{typed.ft.group_restarts} restarts; the other groups trained every step")
        return 0
    failed = next(g for g, code in enumerate(codes) if code != 0)
    if codes[failed] in SAID_BY_WORKER:
        return codes[failed]
    say(f"ddptrain: replica group {failed} failed (exit code {codes[failed]}) after ft.group_restarts="
        f"{typed.ft.group_restarts} restarts; the other groups' exit codes: {codes}")
    return 1
