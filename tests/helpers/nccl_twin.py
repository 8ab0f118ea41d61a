"""An NCCL-semantics twin for the hang tests: NCCL's failure behaviour on CPU, over gloo.

What a real NCCL job does when a collective never completes (torch 2.13's ``ProcessGroupNCCL``, read from its
source), and what this twin does in its place:

- A collective's Python call never raises a timeout. NCCL returns at enqueue and the host blocks later, at a
  sync on the stream; here the call enqueues on an inner gloo group (whose own timeout is pushed far out) and
  blocks the caller until the inner collective completes. A peer that died or left gives no error here either
  (on NCCL the kernel just spins): the caller blocks on.
- A watchdog thread aborts the process ``dist.timeout_s`` after the collective was enqueued: it logs NCCL's
  "Watchdog caught collective operation timeout" line, writes this rank's flight-recorder dump to
  ``TORCH_FR_DUMP_TEMP_FILE`` (or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``~/.cache/torch/
  comm_lib_trace_rank_``) + global rank, signals the other ranks through the group's store to dump theirs, and
  then SIGABRTs the process from a native thread (no Python exception, no Python frame on the aborting thread,
  as ``std::abort`` from NCCL's watchdog). ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` turns the dump off, as on NCCL.
- The flight recorder: each collective is an entry with NCCL's keys (``collective_seq_id``, ``profiling_name``
  ``nccl:<op>``, ``input_sizes``/``input_dtypes``, ``state`` scheduled/started/completed, ``frames``, ...) in a
  dump with ``version``, ``pg_config``, ``pg_status`` and ``entries``, pickled as torch pickles it;
  ``torch._C._distributed_c10d._dump_nccl_trace`` returns it (a CPU build of torch has no such function).
- Another rank that sees the dump signal (polled every second, as ``TORCH_NCCL_COORD_CHECK_MILSEC``) writes its
  dump too and carries on; real NCCL aborts it after ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (8 min), by which
  time the launcher has stopped it.

Not emulated: the host running ahead of the stream (on a GPU a rank may enqueue several more collectives
before it blocks; here it blocks in the first one), CUDA events and timing, NCCL's desync report, error
propagation between ranks (``TORCH_NCCL_PROPAGATE_ERROR``), the heartbeat monitor's own abort, NCCL's
communicator and its kernels. Collectives run on gloo underneath, so results are gloo's.

Turned on by ``TWIN_NCCL=1`` with ``tests/helpers/nccl_twin_site`` on ``PYTHONPATH`` (its ``sitecustomize``
loads this file and installs the twin when ``torch.distributed`` is imported): ``init_process_group("gloo")``
then builds this backend (its name: ``nccl_twin``). The product never names it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKEND = "nccl_twin"
ENV = "TWIN_NCCL"
DUMP_SIGNAL = "nccl_twin/exception_dump"  # the store key a timed-out rank sets (NCCL's "exception_dump")
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


@dataclass
class _Recorder:
    """The process's flight recorder (one for every group, as NCCL's is): entries in a ring of
    ``TORCH_FR_BUFFER_SIZE`` (NCCL's default 2000)."""

    size: int = field(default_factory=lambda: int(os.environ.get("TORCH_FR_BUFFER_SIZE",
                                                                 os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", 2000))))
    entries: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, dict[str, int]] = field(default_factory=dict)
    config: dict[str, dict[str, str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 0

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock:
            entry["record_id"] = self.next_id
            self.next_id += 1
            self.entries.append(entry)
            del self.entries[: max(0, len(self.entries) - self.size)]

    def dump(self, include_collectives: bool = True, include_stack_traces: bool = True,
             only_active: bool = False) -> bytes:
        """What ``_dump_nccl_trace`` returns: torch's pickled dump (protocol 2, plain dicts and lists)."""
        with self.lock:
            entries = [dict(e) for e in self.entries if not (only_active and e["state"] == "completed")]
        for e in entries:
            if not include_stack_traces:
                e.pop("frames", None)
        trace: dict[str, Any] = {"version": "2.10", "comm_lib_version": "nccl_twin", "pg_config": dict(self.config),
                                 "pg_status": dict(self.status)}
        if include_collectives:
            trace["entries"] = entries
        return pickle.dumps(trace, protocol=2)


RECORDER = _Recorder()


class TwinGroup(dist.ProcessGroup):
    """A process group with NCCL's failure behaviour over an inner gloo group (module docstring)."""

    def __init__(self, opts: Any) -> None:
        super().__init__(opts.group_rank, opts.group_size)
        self.timeout = opts.timeout
        # gloo's own timeout far out: the watchdog acts first, at the configured timeout, as NCCL's does
        far = opts.timeout * 4 + timedelta(seconds=30)
        self._inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, far)
        self._store = opts.store
        self._pg_id = len(RECORDER.status)
        self._pg_name = (str(opts.group_id), "default_pg" if self._pg_id == 0 else "undefined")
        self._seq = 0
        self._p2p_seq = 0
        RECORDER.status[str(self._pg_id)] = {"last_enqueued_collective": 0, "last_started_collective": 0,
                                             "last_completed_collective": 0}
        RECORDER.config[self._pg_name[0]] = {"name": self._pg_name[0], "desc": self._pg_name[1],
                                             "ranks": str(list(range(opts.group_size)))}
        WATCHDOG.watch(self)

    def getBackendName(self) -> str:
        return BACKEND

    @staticmethod
    def _seq_of(entry: dict[str, Any]) -> int:
        return int(entry["collective_seq_id"])

    def _enqueue(self, name: str, args: tuple, kwargs: dict) -> Any:
        op, inner, inputs = _OPS[name] if name in _OPS else (_P2P[name], name, lambda a: list(a[0]))
        p2p = name in _P2P
        if p2p:
            self._p2p_seq += 1
        else:
            self._seq += 1
        tensors = inputs(args)
        now = time.time_ns()
        entry = {"pg_id": self._pg_id, "process_group": self._pg_name, "thread_name": threading.current_thread().name,
                 "thread_id": str(threading.get_ident()), "collective_seq_id": self._seq,
                 "p2p_seq_id": self._p2p_seq, "op_id": self._seq, "profiling_name": f"nccl:{op}",
                 "time_created_ns": now, "input_sizes": [list(t.shape) for t in tensors],
                 "input_dtypes": [_DTYPES.get(t.dtype, "Float") for t in tensors],
                 # in place, as the ops here mostly are (gathers and scatters have other outputs: not recorded)
                 "output_sizes": [list(t.shape) for t in tensors],
                 "output_dtypes": [_DTYPES.get(t.dtype, "Float") for t in tensors], "state": "started",
                 "time_discovered_started_ns": now,
                 "time_discovered_completed_ns": None, "retired": False,
                 "timeout_ms": int(self.timeout.total_seconds() * 1000), "is_p2p": p2p,
                 "frames": [{"name": f.name, "filename": f.filename, "line": f.lineno}
                            for f in reversed(traceback.extract_stack()[:-2])]}
        RECORDER.record(entry)
        status = RECORDER.status[str(self._pg_id)]
        if not p2p:
            status["last_enqueued_collective"] = status["last_started_collective"] = self._seq
        work = getattr(self._inner, inner)(*args, **kwargs)
        done = torch.futures.Future()

        def completed(value: Any) -> None:
            entry["state"], entry["retired"] = "completed", True
            entry["time_discovered_completed_ns"] = time.time_ns()
            if not p2p:
                status["last_completed_collective"] = max(status["last_completed_collective"], self._seq_of(entry))
            done.set_result(value)

        WATCHDOG.pending(entry, time.monotonic() + self.timeout.total_seconds(), self)
        _on_completion(work, completed)
        return torch._C._distributed_c10d._create_work_from_future(done)


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
    """NCCL's watchdog and heartbeat monitor in one thread: a timeout dumps, signals the others, and aborts."""

    def __init__(self) -> None:
        self._pending: list[tuple[dict[str, Any], float, TwinGroup]] = []
        self._groups: list[TwinGroup] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dumped = False

    def watch(self, group: TwinGroup) -> None:
        with self._lock:
            self._groups.append(group)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="pt_nccl_watchdg")
                self._thread.start()

    def pending(self, entry: dict[str, Any], deadline: float, group: TwinGroup) -> None:
        with self._lock:
            self._pending.append((entry, deadline, group))

    def _run(self) -> None:
        last_poll = time.monotonic()
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self._lock:
                self._pending = [p for p in self._pending if p[0]["state"] != "completed"]
                late = next((p for p in self._pending if now > p[1]), None)
            if late is not None:
                self._time_out(*late)
            if now - last_poll >= float(os.environ.get("TORCH_NCCL_COORD_CHECK_MILSEC", 1000)) / 1e3:
                last_poll = now
                self._poll_dump_signal()

    def _time_out(self, entry: dict[str, Any], deadline: float, group: TwinGroup) -> None:
        rank = dist.get_rank() if dist.is_initialized() else group.rank()
        ran_ms = int((time.time_ns() - entry["time_created_ns"]) / 1e6)
        print(f"[rank{rank}]:[E nccl_twin] [Rank {rank}] Watchdog caught collective operation timeout: "
              f"WorkNCCL(SeqNum={entry['collective_seq_id']}, OpType={entry['profiling_name'].split(':')[1].upper()}, "
              f"Timeout(ms)={entry['timeout_ms']}) ran for {ran_ms} milliseconds before timing out.",
              file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # best effort, as NCCL's
            group._store.set(DUMP_SIGNAL, str(rank))
        self._dump(rank)
        print(f"[rank{rank}]:[F nccl_twin] [Rank {rank}] Terminating the process after attempting to dump debug "
              "info, due to collective timeout or exception.", file=sys.stderr, flush=True)
        _abort_from_native_thread()

    def _poll_dump_signal(self) -> None:
        if self._dumped:
            return
        for group in list(self._groups):
            try:
                signalled = group._store.check([DUMP_SIGNAL])
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing to dump for
                return
            if signalled:
                self._dump(dist.get_rank() if dist.is_initialized() else group.rank())
                return

    def _dump(self, rank: int) -> None:
        if self._dumped or os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1") == "0" or RECORDER.size <= 0:
            return
        self._dumped = True
        prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
                  or str(Path.home() / ".cache" / "torch" / "comm_lib_trace_rank_"))
        try:
            Path(f"{prefix}{rank}").write_bytes(RECORDER.dump())
        except OSError as exc:
            print(f"[rank{rank}]:[E nccl_twin] Error opening file for writing Flight Recorder debug info: {exc}",
                  file=sys.stderr, flush=True)


WATCHDOG = _Watchdog()


def nccl_dump(collectives: list[tuple[int, str, int, str]]) -> bytes:
    """A dump in the format above of the default group's collectives ``(seq, op, bytes, state)`` (fp32 inputs),
    for tests that write a rank's evidence by hand."""
    recorder = _Recorder()
    recorder.config["0"] = {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}
    for seq, op, nbytes, state in collectives:
        recorder.record({"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0,
                         "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": 0,
                         "input_sizes": [[nbytes // 4]], "input_dtypes": ["Float"],
                         "output_sizes": [[nbytes // 4]], "output_dtypes": ["Float"], "state": state,
                         "time_discovered_started_ns": None,
                         "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 0,
                         "is_p2p": False, "frames": []})
    return recorder.dump()


def _abort_from_native_thread() -> None:
    """SIGABRT raised on a thread Python does not know, as ``std::abort`` in NCCL's watchdog thread."""
    try:
        libc = ctypes.CDLL(None)
        thread = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.abort, ctypes.c_void_p), None)
        time.sleep(30)  # the process dies on that thread
    finally:
        os.abort()


def _create(opts: Any, _options: Any) -> TwinGroup:
    return TwinGroup(opts)


def install() -> None:
    """Register the backend, make ``init_process_group("gloo")`` build it, and serve ``_dump_nccl_trace``."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    original = c10d.init_process_group

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
        return original(BACKEND if backend in (None, "gloo", "cpu:gloo") else backend, *args, **kwargs)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    torch._C._distributed_c10d._dump_nccl_trace = RECORDER.dump
