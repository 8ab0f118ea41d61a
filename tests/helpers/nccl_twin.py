"""An NCCL-semantics twin for the hang tests: NCCL's behaviour where the hang verdict depends on it, on CPU, over gloo.

What a real NCCL job does (torch 2.13's ``ProcessGroupNCCL`` and flight recorder, read from their source), and what
this twin does in its place:

- **Host run-ahead.** A collective returns at enqueue and completes later on the device; ``wait()`` only orders
  the compute stream after it, so the host goes on enqueuing (the rest of a backward's buckets, FSDP2's next
  all-gathers, the step's other collectives) until it reads a device value. Here a collective is enqueued on an
  inner gloo group and returns at once; a ``wait()`` (or the work's future, which DDP's reducer waits on) blocks
  the host while the collective completes, as a CPU must (the tensors are the result), but for at most
  ``run_ahead_after_s`` (default: half the group's timeout): a collective still unfinished then is one a peer
  never joined, and the host goes on as NCCL's would have, enqueuing what follows. Two waits never let the host
  go: a barrier (NCCL's barrier synchronizes the host with the stream) and the collectives inside
  ``*_object*`` calls (the host reads their results at once, a device-to-host copy on a GPU). Once a collective
  let the host go unfinished, the group's later collectives are recorded but never run (on NCCL they queue on
  the stream behind it), so no mismatched traffic reaches gloo.
- **The flight recorder.** One ring for the process (``TORCH_FR_BUFFER_SIZE``, default 2000; 0: off), every
  group's collectives in it, with NCCL's keys (``collective_seq_id`` per group, ``profiling_name``
  ``nccl:<op>``, ``input_sizes``/``input_dtypes``, ``state``, ``process_group`` (name, description), ``pg_id``);
  the dump has ``version``, ``pg_config`` (each group's global ranks), ``pg_status`` (per ``pg_id``: last enqueued,
  started and completed collective, -1 until there is one, from the group's first entry on) and ``entries``,
  pickled as torch pickles it (``tests/test_verdict.py`` checks these keys and values against torch's own
  recorder); ``_dump_nccl_trace`` returns it (a CPU build of torch has no such function). Timing is off, as by
  default: an entry stays ``scheduled`` until the watchdog discovers its completion (polled every 100 ms, in order
  per group, as a stream completes them), then it is ``completed``; ``started`` is never seen.
- **The watchdog.** ``dist.timeout_s`` after a collective was enqueued and not completed, it logs NCCL's
  "Watchdog caught collective operation timeout" line, sets the dump signal in the job's store, asks the heartbeat
  monitor for this rank's dump, waits for it (at most ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, 15 s) and then
  SIGABRTs the process from a native thread (no Python exception, no Python frame on the aborting thread, as
  ``std::abort`` from NCCL's watchdog). A peer that died or left gives no error (on NCCL the kernel just spins).
- **The heartbeat monitor.** Its own thread, waking every ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s): it writes the
  dump (to ``TORCH_FR_DUMP_TEMP_FILE``, or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``~/.cache/torch/
  comm_lib_trace_rank_``, + global rank) when this rank's watchdog asked or another rank's signal is in the
  store, so a dump lands up to a second after the timeout while the host may still be enqueuing.
  ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` turns the dump off.
- **Sub-groups.** ``new_group`` and device-mesh groups (HSDP's shard and replica groups) are twin groups too,
  each with its own sequence numbers, ``pg_id`` and ``pg_config`` entry (its name, description and global ranks).

Not emulated: the host running past a wait while the collective is merely slow (here it blocks up to
``run_ahead_after_s``), past a read of a pending result (a CPU tensor is read at once), CUDA events and
timing, NCCL's desync report, error propagation between ranks (``TORCH_NCCL_PROPAGATE_ERROR``), the heartbeat
monitor's own abort of a rank whose watchdog is stuck (8 minutes), ``split_group`` (groups are built with
``new_group``), NCCL's communicator, kernels and streams. Collectives run on gloo underneath, so results are gloo's.

Turned on by ``TWIN_NCCL=1`` with ``tests/helpers/nccl_twin_site`` on ``PYTHONPATH`` (its ``sitecustomize``
loads this file and installs the twin when ``torch.distributed`` is imported): ``init_process_group("gloo")``
then builds this backend (its name: ``nccl_twin``). The product never names it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKEND = "nccl_twin"
ENV = "TWIN_NCCL"
RUN_AHEAD_ENV = "TWIN_NCCL_RUN_AHEAD_AFTER_S"  # seconds a wait blocks on an unfinished collective (default: timeout/2)
DUMP_SIGNAL = "nccl_twin/exception_dump"  # the store key a timed-out rank sets (NCCL's "exception_dump")
WATCHDOG_POLL_S = 0.1  # NCCL's watchdog loop (kWatchdogThreadSleepMillis)
_DTYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
           torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
           torch.bool: "Bool"}
# ProcessGroup method -> (NCCL's profiling name, inner gloo method, where its input tensors are)
_OPS: dict[str, tuple[str, str, Callable[[tuple], list[torch.Tensor]]]] = {
    "allreduce": ("all_reduce", "allreduce", lambda a: list(a[0])),
    "allreduce_coalesced": ("allreduce_coalesced", "allreduce_coalesced", lambda a: list(a[0])),
    "broadcast": ("broadcast", "broadcast", lambda a: list(a[0])),
    "allgather": ("all_gather", "allgather", lambda a: list(a[1])),
    "allgather_coalesced": ("allgather_coalesced", "allgather_coalesced", lambda a: list(a[1])),
    "all_gather_single": ("_allgather_base", "_allgather_base", lambda a: [a[1]]),
    "allgather_into_tensor_coalesced": ("allgather_into_tensor_coalesced", "allgather_into_tensor_coalesced",
                                        lambda a: list(a[1])),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter", lambda a: list(a[0])),
    "reduce_scatter_single": ("_reduce_scatter_base", "_reduce_scatter_base", lambda a: [a[1]]),
    "alltoall": ("all_to_all", "alltoall", lambda a: list(a[1])),
    "all_to_all_single": ("all_to_all", "alltoall_base", lambda a: [a[1]]),
    "gather": ("gather", "gather", lambda a: list(a[1])),
    "scatter": ("scatter", "scatter", lambda a: list(a[0])),
    "reduce": ("reduce", "reduce", lambda a: list(a[0])),
    "barrier": ("all_reduce_barrier", "barrier", lambda a: [torch.zeros(1)]),  # NCCL's barrier: a 1-element all-reduce
}
_P2P = {"send": "send", "recv": "recv"}
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                       "send_object_list", "recv_object_list")
# torch 2.13's ProcessGroupStatus before any collective (c10d/logger.hpp: lastEnqueuedSeq{-1}, lastStartedSeq{-1},
# lastCompletedSeq{-1}, "-1 to indicate no collective has been completed"), as getPgStatus() dumps it; NCCL numbers
# a group's collectives from 1, so a group whose first collective hangs shows -1 as its last completed one.
INITIAL_STATUS = {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1}
_HOST_READS = threading.local()  # depth of *_object* calls on this thread: their collectives never release the host


@dataclass
class _Entry:
    """One collective: its flight-recorder entry, and what only the twin knows (done on gloo, host released)."""

    record: dict[str, Any]
    group: TwinGroup
    deadline: float  # monotonic time of its timeout
    release: Callable[[], None]  # lets the host past its wait
    release_at: float | None  # monotonic time the host goes on without it (None: never, a barrier or a read)
    done: threading.Event = field(default_factory=threading.Event)  # completed underneath (not yet discovered)


@dataclass
class _Recorder:
    """The process's flight recorder (one ring for every group, as torch's is)."""

    size: int = field(default_factory=lambda: int(os.environ.get("TORCH_FR_BUFFER_SIZE",
                                                                 os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", 2000))))
    entries: list[dict[str, Any]] = field(default_factory=list)
    groups: list[TwinGroup] = field(default_factory=list)
    status: dict[str, dict[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 0

    def record(self, entry: dict[str, Any], status: dict[str, int]) -> None:
        """Add ``entry`` to the ring; its group's ``status`` joins the dump with the group's first entry, as torch
        registers a group's ``ProcessGroupStatus`` at its first record (a group with none has no ``pg_status``)."""
        if self.size <= 0:
            return
        with self.lock:
            self.status.setdefault(str(entry["pg_id"]), status)
            entry["record_id"] = self.next_id
            self.next_id += 1
            self.entries.append(entry)
            del self.entries[: max(0, len(self.entries) - self.size)]

    def dump(self, include_collectives: bool | None = True, include_stack_traces: bool | None = True,
             only_active: bool | None = False) -> bytes:
        """What ``_dump_nccl_trace`` returns: torch's pickled dump (protocol 2, plain dicts and lists)."""
        with self.lock:
            entries = [dict(e) for e in self.entries if not (only_active and e["state"] == "completed")]
            status = {k: dict(v) for k, v in self.status.items()}
        for e in entries:
            if include_stack_traces is False:
                e.pop("frames", None)
        config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.global_ranks)} for g in self.groups}
        trace: dict[str, Any] = {"version": "2.10", "comm_lib_version": "nccl_twin", "pg_config": config,
                                 "pg_status": status}
        if include_collectives is not False:
            trace["entries"] = entries
        return pickle.dumps(trace, protocol=2)


RECORDER = _Recorder()


class TwinGroup(dist.ProcessGroup):
    """A process group with NCCL's host and failure behaviour over an inner gloo group (module docstring)."""

    def __init__(self, opts: Any) -> None:
        super().__init__(opts.group_rank, opts.group_size)
        self.timeout = opts.timeout
        # gloo's own timeout far out: the watchdog acts first, at the configured timeout, as NCCL's does
        far = opts.timeout * 4 + timedelta(seconds=30)
        self._inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, far)
        self.store = opts.store
        self.global_ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        self._fallback_name = str(opts.group_id)
        self.pg_id = len(RECORDER.groups)  # torch's pg_id: this process's count of groups so far
        self._seq = 0
        self._p2p_seq = 0
        self._discovered = 0  # the last collective the watchdog found completed (in order, as a stream's)
        self.pending: list[_Entry] = []
        self.stalled = False  # a collective of this group let the host go unfinished: nothing after it runs
        self.fr_status = dict(INITIAL_STATUS)  # torch's ProcessGroupStatus: the dump shows it from the first entry on
        RECORDER.groups.append(self)
        WATCHDOG.watch(self)

    # torch keeps a group's name and description on its backends; this group is its own backend (a Python
    # ProcessGroup that c10d returns as it is), so it keeps them itself: device meshes read ``group_name``.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return str(getattr(self, "_name", "") or self._fallback_name)

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return str(getattr(self, "_desc", "") or ("default_pg" if self.group_name == "0" else "undefined"))

    @property
    def name(self) -> str:
        return self.group_name

    @property
    def desc(self) -> str:
        return self.group_desc

    def getBackendName(self) -> str:
        return BACKEND

    def _enqueue(self, name: str, args: tuple, kwargs: dict) -> Any:
        op, inner, inputs = _OPS[name] if name in _OPS else (_P2P[name], name, lambda a: list(a[0]))
        p2p = name in _P2P
        if p2p:
            self._p2p_seq += 1
        else:
            self._seq += 1
        tensors = inputs(args)
        record = {"pg_id": self.pg_id, "process_group": (self.name, self.desc),
                  "thread_name": threading.current_thread().name, "thread_id": str(threading.get_ident()),
                  "collective_seq_id": self._seq, "p2p_seq_id": self._p2p_seq, "op_id": self._seq,
                  "profiling_name": f"nccl:{op}", "time_created_ns": time.time_ns(),
                  "input_sizes": [list(t.shape) for t in tensors],
                  "input_dtypes": [_DTYPES.get(t.dtype, "Float") for t in tensors],
                  # in place, as the ops here mostly are (gathers and scatters have other outputs: not recorded)
                  "output_sizes": [list(t.shape) for t in tensors],
                  "output_dtypes": [_DTYPES.get(t.dtype, "Float") for t in tensors],
                  "state": "scheduled", "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                  "retired": False, "timeout_ms": int(self.timeout.total_seconds() * 1000), "is_p2p": p2p,
                  "frames": [{"name": f.name, "filename": f.filename, "line": f.lineno}
                             for f in reversed(traceback.extract_stack()[:-2])]}
        RECORDER.record(record, self.fr_status)
        host = torch.futures.Future()  # what the host's wait (and DDP's reducer) waits on
        lock = threading.Lock()

        def release(value: Any = None) -> None:
            with lock:
                if not host.done():
                    host.set_result(_results(name, args) if value is None else value)

        now = time.monotonic()
        holds_host = name == "barrier" or getattr(_HOST_READS, "depth", 0) > 0
        after = float(os.environ.get(RUN_AHEAD_ENV, self.timeout.total_seconds() / 2))
        entry = _Entry(record, self, now + self.timeout.total_seconds(), release,
                       None if holds_host else now + after)
        if not p2p:
            with RECORDER.lock:
                self.fr_status["last_enqueued_collective"] = self._seq
            WATCHDOG.pending(entry)
        if not self.stalled:  # behind a stuck collective, NCCL's stream never runs it: gloo is not asked
            work = getattr(self._inner, inner)(*args, **kwargs)

            def completed(value: Any) -> None:
                entry.done.set()
                release(value)

            _on_completion(work, completed)
        return torch._C._distributed_c10d._create_work_from_future(host)

    def discover(self) -> None:
        """The watchdog's poll: mark the collectives completed underneath, in order, as completed."""
        with RECORDER.lock:
            while self.pending and self.pending[0].done.is_set():
                entry = self.pending.pop(0)
                entry.record.update(state="completed", retired=True, time_discovered_completed_ns=time.time_ns())
                self._discovered = int(entry.record["collective_seq_id"])
                self.fr_status["last_completed_collective"] = self._discovered


def _results(name: str, args: tuple) -> Any:
    """What a future's value is for this op (the tensors it writes), as gloo's own futures give it."""
    if name in ("allgather", "allgather_coalesced", "gather"):
        return args[0]
    if name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "reduce_scatter",
                "allgather_into_tensor_coalesced", "alltoall"):
        return [args[0]] if isinstance(args[0], torch.Tensor) else args[0]
    return args[0] if args and isinstance(args[0], list) else []


def _on_completion(work: Any, completed: Callable[[Any], None]) -> None:
    """Call ``completed`` when gloo's work succeeds; on its error, never (an NCCL kernel waiting for a peer that
    left keeps waiting until the watchdog's timeout)."""
    try:
        future = work.get_future()
    except RuntimeError:  # some gloo works have no future: wait for them on a thread
        def wait() -> None:
            try:
                work.wait()
            except RuntimeError:
                return
            completed([])

        threading.Thread(target=wait, daemon=True, name="nccl_twin_work").start()
        return

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except RuntimeError:
            return
        completed(value)

    future.add_done_callback(done)


def _method(name: str) -> Callable[..., Any]:
    def call(self: TwinGroup, *args: Any, **kwargs: Any) -> Any:
        return self._enqueue(name, args, kwargs)

    call.__name__ = name
    return call


for _name in (*_OPS, *_P2P):
    setattr(TwinGroup, _name, _method(_name))


class _Watchdog:
    """NCCL's watchdog (discovers completions, times collectives out, aborts) and heartbeat monitor (dumps)."""

    def __init__(self) -> None:
        self._groups: list[TwinGroup] = []
        self._lock = threading.Lock()
        self._started = False
        self._dump_asked = threading.Event()
        self._dumped = threading.Event()

    def watch(self, group: TwinGroup) -> None:
        with self._lock:
            self._groups.append(group)
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, daemon=True, name="pt_nccl_watchdg").start()
                threading.Thread(target=self._monitor, daemon=True, name="pt_nccl_heartbt").start()

    def pending(self, entry: _Entry) -> None:
        with RECORDER.lock:
            entry.group.pending.append(entry)

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_POLL_S)
            now = time.monotonic()
            late = None
            for group in list(self._groups):
                group.discover()
                with RECORDER.lock:
                    pending = list(group.pending)
                for entry in pending:  # a peer never joined it: the host goes on, as NCCL's never stopped
                    if entry.release_at is not None and now > entry.release_at:
                        entry.release_at = None
                        group.stalled = True
                        entry.release()
                if pending and now > pending[0].deadline and late is None:
                    late = pending[0]
            if late is not None:
                self._time_out(late)

    def _time_out(self, entry: _Entry) -> None:
        rank = _rank(entry.group)
        record = entry.record
        ran_ms = int((time.time_ns() - record["time_created_ns"]) / 1e6)
        op = record["profiling_name"].split(":")[1].upper()
        print(f"[rank{rank}]:[E nccl_twin] [Rank {rank}] Watchdog caught collective operation timeout: "
              f"WorkNCCL(SeqNum={record['collective_seq_id']}, OpType={op}, "
              f"Timeout(ms)={record['timeout_ms']}) ran for {ran_ms} milliseconds before timing out.",
              file=sys.stderr, flush=True)
        for group in list(self._groups):  # every group's store, so a peer polling any of them sees it
            with contextlib.suppress(Exception):  # best effort, as NCCL's
                group.store.set(DUMP_SIGNAL, str(rank))
        if _dump_on_timeout():
            self._dump_asked.set()
            self._dumped.wait(float(os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", 15000)) / 1e3)
        print(f"[rank{rank}]:[F nccl_twin] [Rank {rank}] Terminating the process after attempting to dump debug "
              "info, due to collective timeout or exception.", file=sys.stderr, flush=True)
        _abort_from_native_thread()

    def _monitor(self) -> None:
        """The heartbeat monitor: each interval, dump if this rank's watchdog asked or a peer signalled."""
        interval = float(os.environ.get("TORCH_NCCL_COORD_CHECK_MILSEC", 1000)) / 1e3
        while not self._dumped.is_set():
            time.sleep(interval)
            if self._dump_asked.is_set() or self._signalled():
                self._dump()
                self._dumped.set()

    def _signalled(self) -> bool:
        for group in list(self._groups):
            try:
                if group.store.check([DUMP_SIGNAL]):
                    return True
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing to dump for
                return False
        return False

    def _dump(self) -> None:
        if not _dump_on_timeout() or RECORDER.size <= 0 or not self._groups:
            return
        rank = _rank(self._groups[0])
        prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
                  or str(Path.home() / ".cache" / "torch" / "comm_lib_trace_rank_"))
        try:
            Path(f"{prefix}{rank}").write_bytes(RECORDER.dump())
        except OSError as exc:
            print(f"[rank{rank}]:[E nccl_twin] Error opening file for writing Flight Recorder debug info: {exc}",
                  file=sys.stderr, flush=True)


WATCHDOG = _Watchdog()


def _rank(group: TwinGroup) -> int:
    return dist.get_rank() if dist.is_initialized() else group.rank()


def _dump_on_timeout() -> bool:
    return os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1") != "0"


def nccl_dump(collectives: list[tuple[Any, ...]], ring: int = 2000,
              groups: dict[str, tuple[str, list[int]]] | None = None) -> bytes:
    """A dump in the format above, for tests that write a rank's evidence by hand. Each collective is
    ``(seq, op, bytes, state)`` of the default group or ``(group name, seq, op, bytes, state)``, fp32 inputs, in
    enqueue order; ``ring`` keeps the last ones, as torch's ring does; ``groups`` gives each group's description
    and global ranks (the default group: ``default_pg``, ranks [0, 1] unless given). ``pg_status`` holds each
    group's last enqueued and last completed collective (those before the first one given count as completed),
    whether or not the ring still holds them, from torch's initial -1 (none), and only for groups with a
    collective (torch adds a group's status at its first entry)."""
    groups = {"0": ("default_pg", [0, 1]), **(groups or {})}
    pg_ids = {name: i for i, name in enumerate(groups)}
    status: dict[str, dict[str, int]] = {}
    entries = []
    for item in collectives:
        group, (seq, op, nbytes, state) = ("0", item) if len(item) == 4 else (item[0], item[1:])
        if str(pg_ids[group]) not in status:  # the collectives before the first one given completed
            status[str(pg_ids[group])] = {**INITIAL_STATUS, "last_completed_collective": seq - 1 if seq > 1 else -1}
        st = status[str(pg_ids[group])]
        st["last_enqueued_collective"] = seq
        if state == "completed":
            st["last_completed_collective"] = max(st["last_completed_collective"], seq)
        entries.append({"record_id": len(entries), "pg_id": pg_ids[group], "process_group": (group, groups[group][0]),
                        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}",
                        "time_created_ns": 0, "input_sizes": [[nbytes // 4]], "input_dtypes": ["Float"],
                        "output_sizes": [[nbytes // 4]], "output_dtypes": ["Float"], "state": state,
                        "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
                        "retired": state == "completed", "timeout_ms": 0, "is_p2p": False, "frames": []})
    config = {name: {"name": name, "desc": desc, "ranks": str(ranks)} for name, (desc, ranks) in groups.items()}
    trace = {"version": "2.10", "comm_lib_version": "nccl_twin", "pg_config": config, "pg_status": status,
             "entries": entries[-ring:] if ring > 0 else []}
    return pickle.dumps(trace, protocol=2)


def _abort_from_native_thread() -> None:
    """SIGABRT raised on a thread Python does not know, as ``std::abort`` in NCCL's watchdog thread."""
    try:
        libc = ctypes.CDLL(None)
        thread = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.abort, ctypes.c_void_p), None)
        time.sleep(30)  # the process dies on that thread
    finally:
        os.abort()


@contextlib.contextmanager
def _reading_results() -> Iterator[None]:
    _HOST_READS.depth = getattr(_HOST_READS, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST_READS.depth -= 1


def _holding_the_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _reading_results():
            return fn(*args, **kwargs)

    return call


def _create(opts: Any, _options: Any) -> TwinGroup:
    return TwinGroup(opts)


def install() -> None:
    """Register the backend, make ``init_process_group("gloo")`` build it (and ``new_group`` with the default
    backend, device meshes included), serve ``_dump_nccl_trace``, and keep the host in ``*_object*`` calls."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    original = c10d.init_process_group

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
        return original(BACKEND if backend in (None, "gloo", "cpu:gloo") else backend, *args, **kwargs)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    for name in _OBJECT_COLLECTIVES:
        wrapped = _holding_the_host(getattr(c10d, name))
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    torch._C._distributed_c10d._dump_nccl_trace = RECORDER.dump
