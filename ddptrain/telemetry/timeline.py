"""One training step from a torch.profiler Chrome trace, drawn as lanes: what computed, what communicated, and how
much of the communication hid behind the compute (the overlap that decides how well DDP scales).

The trace is what ``torch.profiler.profile(schedule=...).export_chrome_trace(path)`` writes: ``ProfilerStep#N``
ranges on the training thread. On CPU (gloo), compute is the training thread's outermost ops and collectives run
on gloo's own threads, so communication is gathered from every thread. On CUDA, compute is the non-collective
kernels and communication the NCCL kernels, each kernel belonging to the step within whose window some thread of
the process launched it: backward runs on the autograd engine's device thread, not the training thread, and
NCCL >= 2.19 launches through the driver (``cuLaunchKernelEx``, category ``cuda_driver``), not the runtime.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain.comm.accounting import union

COMM = re.compile(r"gloo:|nccl|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.I)
STEP = re.compile(r"ProfilerStep#(\d+)")
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the categories of a kernel launch on the host
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#DD8452", "other": "#8C8C8C"}
COMM_COLOR, EXPOSED_COLOR = "#8172B3", "#C44E52"
Intervals = list[tuple[float, float]]


@dataclass(frozen=True)
class Event:
    """One complete ('X') trace event; times in microseconds as the trace holds them."""

    name: str
    cat: str
    lane: tuple[Any, Any]  # (pid, tid): a CPU thread, or a GPU device and stream
    start: float
    end: float
    args: dict[str, Any]


@dataclass
class StepTimeline:
    """One step's busy intervals, in seconds from the step's start."""

    step: int
    duration: float
    compute: list[tuple[float, float, str]]  # (start, end, phase)
    comm: dict[str, Intervals]  # lane label -> intervals

    def figures(self) -> dict[str, float]:
        """Step length, busy time of compute and of communication, and how much of the latter hid behind the former."""
        compute = union([(s, e) for s, e, _ in self.compute])
        comm = union([iv for ivs in self.comm.values() for iv in ivs])
        overlap = total(intersect(compute, comm))
        comm_s = total(comm)
        phases = {f"{p}_s": total(union([(s, e) for s, e, q in self.compute if q == p])) for p in PHASE_COLORS}
        return {
            "step": self.step, "step_s": self.duration, "compute_s": total(compute), "comm_s": comm_s,
            "overlap_s": overlap, "exposed_comm_s": comm_s - overlap,
            "overlap_pct": 100 * overlap / comm_s if comm_s else 0.0, **phases,
        }


def render_timeline(trace_path: Path, out_png: Path, step: int | None = None) -> dict[str, float]:
    """Draw one step of ``trace_path`` (the last recorded unless ``step``) to ``out_png``; return its figures."""
    trace = json.loads(Path(trace_path).read_text())
    timeline = read_step(trace, step)
    figures = timeline.figures()
    draw(timeline, figures, out_png, trace.get("distributedInfo", {}))
    return figures


def read_step(trace: dict[str, Any], step: int | None = None) -> StepTimeline:
    """The compute and communication intervals of one ``ProfilerStep#N`` of a Chrome trace."""
    events = [
        Event(e["name"], e.get("cat", ""), (e.get("pid"), e.get("tid")), float(e["ts"]), float(e["ts"]) + e["dur"],
              e.get("args", {}))
        for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e
    ]
    steps = {int(m.group(1)): e for e in events if e.cat == "user_annotation" and (m := STEP.fullmatch(e.name))}
    if not steps:
        raise ValueError("no ProfilerStep#N in the trace: was the profiler run with a schedule and prof.step()?")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise ValueError(f"step {step} is not in the trace; recorded steps: {sorted(steps)}")
    marker = steps[step]
    ops = outermost([e for e in events if e.lane == marker.lane and e is not marker
                     and marker.start <= e.start < marker.end])
    kernels = launched_kernels(events, marker)
    if kernels:
        # Phases across the threads that launched: forward on the training thread, backward on autograd's.
        lanes = {marker.lane} | {launch.lane for _, launch in kernels}
        labelled = list(zip(*_labelled_ops(events, marker, lanes), strict=True))
        compute = [(k.start, k.end, phase_at([(o, p) for o, p in labelled if o.lane == launch.lane], launch.start))
                   for k, launch in kernels if not COMM.search(k.name)]
        comm_events = [k for k, _ in kernels if COMM.search(k.name)]
    else:
        cpu = [e for e in ops if not COMM.search(e.name)]
        compute = spans(list(zip(cpu, phases(cpu), strict=True)))
        comm_events = [e for e in ops if COMM.search(e.name)] + [
            e for e in events if e.lane != marker.lane and COMM.search(e.name)
            and e.end > marker.start and e.start < marker.end
        ]
    t0, t1 = marker.start, max([marker.end] + [k.end for k, _ in kernels])
    lane_names = thread_names(trace)
    comm: dict[str, Intervals] = {}
    for e in comm_events:
        label = lane_names.get(e.lane) or f"stream {e.lane[1]}"
        comm.setdefault(label, []).append(((max(e.start, t0) - t0) / 1e6, (min(e.end, t1) - t0) / 1e6))
    return StepTimeline(
        step, (t1 - t0) / 1e6, [((start - t0) / 1e6, (end - t0) / 1e6, p) for start, end, p in compute],
        {label: union(ivs) for label, ivs in sorted(comm.items())},
    )


def _labelled_ops(events: list[Event], marker: Event, lanes: set[tuple[Any, Any]]) -> tuple[list[Event], list[str]]:
    """The top-level compute ops of each of ``lanes`` within the step, merged in time order, and their phases."""
    ops = sorted((op for lane in lanes for op in outermost(
        [e for e in events if e.lane == lane and e is not marker and marker.start <= e.start < marker.end]
    ) if not COMM.search(op.name)), key=lambda e: e.start)
    return ops, phases(ops)


def outermost(events: list[Event]) -> list[Event]:
    """Events not nested in another one of the list (one thread's top-level ops), in time order."""
    kept: list[Event] = []
    for e in sorted(events, key=lambda e: (e.start, -e.end)):
        if not kept or e.start >= kept[-1].end:
            kept.append(e)
    return kept


def phases(ops: list[Event]) -> list[str]:
    """forward / backward / optimizer / other for the training thread's top-level ops, in time order.

    Backward ops are the autograd engine's, optimizer ops ``Optimizer.*``; any other op is forward when a backward
    op follows it before the next optimizer op (this covers every micro-batch, whatever wraps the model), else other
    (gradient clipping, logging).
    """
    labels: list[str] = []
    backward_follows = False
    for op in reversed(ops):
        if op.name.startswith("autograd::engine::evaluate_function") or "Backward" in op.name:
            label, backward_follows = "backward", True
        elif op.name.startswith("Optimizer."):
            label, backward_follows = "optimizer", False
        else:
            label = "forward" if backward_follows else "other"
        labels.append(label)
    return labels[::-1]


def spans(ops: list[tuple[Event, str]]) -> list[tuple[float, float, str]]:
    """(start, end, phase) of the training thread's busy time: a run of forward (or backward) ops is one span.

    The gaps inside such a run are the thread running Python or the autograd engine between ops, not idling.
    Other ops keep their gaps: DDP waits there for its all-reduces before copying buckets back to the gradients.
    """
    out: list[tuple[float, float, str]] = []
    for op, phase in ops:
        if out and phase == out[-1][2] and phase in ("forward", "backward"):
            out[-1] = (out[-1][0], op.end, phase)
        else:
            out.append((op.start, op.end, phase))
    return out


def launched_kernels(events: list[Event], marker: Event) -> list[tuple[Event, Event]]:
    """GPU kernels launched (by the runtime or the driver, from any thread of the step's process) within the step,
    each with its launch event."""
    launches = {
        e.args["correlation"]: e for e in events
        if e.cat in LAUNCHES and e.lane[0] == marker.lane[0] and "correlation" in e.args
        and marker.start <= e.start < marker.end
    }
    return [(e, launches[e.args["correlation"]]) for e in events
            if e.cat == "kernel" and e.args.get("correlation") in launches]


def phase_at(ops: list[tuple[Event, str]], ts: float) -> str:
    """The phase of the top-level op running at ``ts`` (a kernel inherits the phase of the op that launched it)."""
    return next((phase for op, phase in ops if op.start <= ts < op.end), "other")


def thread_names(trace: dict[str, Any]) -> dict[tuple[Any, Any], str]:
    """(pid, tid) -> a short lane label from the trace's metadata, e.g. 'pt_gloo_runloop 8861'.

    A thread can be named twice (the process's name, then its own, in either order): its own name wins.
    """
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    process = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    names: dict[tuple[Any, Any], str] = {}
    for e in meta:
        if e.get("name") != "thread_name":
            continue
        match = re.fullmatch(r"thread (\d+) \((.+)\)", e["args"]["name"])
        own, label = (match.group(2), f"{match.group(2)} {match.group(1)}") if match else (None, e["args"]["name"])
        if (e["pid"], e["tid"]) not in names or own != process.get(e["pid"]):
            names[(e["pid"], e["tid"])] = label
    return names


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The intersection of two sorted, disjoint interval lists (as ``union`` returns them)."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The parts of ``a`` not covered by ``b`` (both sorted and disjoint)."""
    out: Intervals = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def total(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def draw(timeline: StepTimeline, figures: dict[str, float], out_png: Path, dist_info: dict[str, Any]) -> None:
    """Lanes top to bottom: compute by phase, one per communication thread or stream, and exposed communication."""
    # matplotlib only when drawing: importing it costs about 0.6 CPU s, and reading a trace needs none of it
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    compute = union([(s, e) for s, e, _ in timeline.compute])
    comm_all = union([iv for ivs in timeline.comm.values() for iv in ivs])
    lanes: list[tuple[str, list[tuple[Intervals, str]]]] = [
        ("compute", [([(s, e) for s, e, q in timeline.compute if q == p], c) for p, c in PHASE_COLORS.items()]),
        *((f"comm: {label}", [(ivs, COMM_COLOR)]) for label, ivs in timeline.comm.items()),
        ("exposed comm", [(subtract(comm_all, compute), EXPOSED_COLOR)]),
    ]
    fig = Figure(figsize=(12, 1.2 + 0.55 * len(lanes)))  # no pyplot: no global backend, nothing to close
    ax = fig.subplots()
    for row, (_, bars) in enumerate(lanes):
        y = len(lanes) - 1 - row
        for intervals, color in bars:
            ax.broken_barh([(s * 1e3, (e - s) * 1e3) for s, e in intervals], (y - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(lanes)), [label for label, _ in reversed(lanes)])
    ax.set_xlim(0, timeline.duration * 1e3)
    ax.set_xlabel("ms from the start of the step")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in [*PHASE_COLORS.values(), COMM_COLOR, EXPOSED_COLOR]]
    ax.legend(handles, [*PHASE_COLORS, "collective in flight", "comm not hidden by compute"], ncol=6,
              loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    who = f"rank {dist_info['rank']} of {dist_info['world_size']} ({dist_info['backend']})" if dist_info else "trace"
    ms = {k: v * 1e3 for k, v in figures.items() if k.endswith("_s")}
    ax.set_title(
        f"{who}, step {timeline.step}: {ms['step_s']:.1f} ms\n"
        f"compute {ms['compute_s']:.1f} ms | comm {ms['comm_s']:.1f} ms, "
        f"{figures['overlap_pct']:.0f}% overlapped with compute ({ms['exposed_comm_s']:.1f} ms exposed)"
    )
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
