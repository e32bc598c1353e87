"""Calls as spans, written in the Chrome trace event format (Perfetto and chrome://tracing open it).

A real run (``plexrl trace --coordinator ADDR --out run.json``, or ``client.trace()``) and a
simulated one (``Simulation(..., record_timeline=True)``) give the same ``Span`` list, so both open
in the same viewer: one track per device (which job's call runs, and moves of jobs' state between
device and host), and one per job (its calls, each after the time it waited at the coordinator,
and the tool waits its trajectories reported).
"""

from __future__ import annotations

from typing import Any

import msgspec

DEVICES_PID, JOBS_PID = 1, 2


class Span(msgspec.Struct, frozen=True):
    device: str  # the worker (a simulated device) that ran the call; "": none (a tool wait, job track only)
    job: str
    kind: str  # generate, forward_backward, optim_step, ..., swap_to_device / swap_to_host, sleep / wake, tool
    start_s: float  # seconds since the run (the coordinator) started
    end_s: float
    queued_s: float = 0.0  # waited at the coordinator before start_s
    outcome: str = "ok"  # "ok" | "error"


def chrome_trace(spans: list[Span], title: str = "plexrl") -> dict[str, Any]:
    """The trace event JSON object: complete ("X") events on a device track and a job track each,
    a "queued" event before a call that waited, and the tracks' names as metadata ("M") events."""
    devices = {d: i for i, d in enumerate(sorted({s.device for s in spans if s.device}))}
    jobs = {j: i for i, j in enumerate(sorted({s.job for s in spans}))}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": DEVICES_PID, "tid": 0, "args": {"name": f"{title}: devices"}},
        {"name": "process_name", "ph": "M", "pid": JOBS_PID, "tid": 0, "args": {"name": f"{title}: jobs"}},
    ]
    events += [{"name": "thread_name", "ph": "M", "pid": DEVICES_PID, "tid": t, "args": {"name": d}}
               for d, t in devices.items()]  # fmt: skip
    events += [{"name": "thread_name", "ph": "M", "pid": JOBS_PID, "tid": t, "args": {"name": j}}
               for j, t in jobs.items()]  # fmt: skip
    for s in sorted(spans, key=lambda s: s.start_s):
        ts, dur = round(s.start_s * 1e6, 3), round(max(0.0, s.end_s - s.start_s) * 1e6, 3)
        args = {"job": s.job, "device": s.device, "outcome": s.outcome}
        if s.device:
            events.append({"name": s.kind, "cat": "call", "ph": "X", "ts": ts, "dur": dur, "pid": DEVICES_PID,
                           "tid": devices[s.device], "args": args})  # fmt: skip
        events.append({"name": s.kind, "cat": "call", "ph": "X", "ts": ts, "dur": dur, "pid": JOBS_PID,
                       "tid": jobs[s.job], "args": args})  # fmt: skip
        if s.queued_s > 0:
            queued = round(s.queued_s * 1e6, 3)
            events.append({"name": "queued", "cat": "queue", "ph": "X", "ts": round(ts - queued, 3), "dur": queued,
                           "pid": JOBS_PID, "tid": jobs[s.job], "args": {"kind": s.kind}})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def check_trace(trace: Any) -> None:
    """Raise ``ValueError`` unless ``trace`` is a trace event JSON object this module's events obey:
    every event has a name, a phase, a pid and a tid; complete events a numeric ts and dur >= 0;
    metadata events a name in args."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("a trace is a JSON object with a traceEvents list")
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict) or not {"name", "ph", "pid", "tid"} <= e.keys():
            raise ValueError(f"event {i} lacks name, ph, pid or tid: {e!r}")
        if e["ph"] == "X":
            if not all(isinstance(e.get(k), int | float) for k in ("ts", "dur")) or e["dur"] < 0:
                raise ValueError(f"complete event {i} needs numeric ts and dur >= 0: {e!r}")
        elif e["ph"] == "M":
            if not isinstance(e.get("args"), dict) or "name" not in e["args"]:
                raise ValueError(f"metadata event {i} needs args.name: {e!r}")
        else:
            raise ValueError(f"event {i}: phase {e['ph']!r} is not one plexrl writes (X, M)")


def plot(spans: list[Span], path: str, title: str = "plexrl") -> None:
    """A picture of the trace (matplotlib): the device tracks, then the job tracks, each call a bar
    coloured by its job (tool waits hatched grey, state moves black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = sorted({s.device for s in spans if s.device})
    jobs = sorted({s.job for s in spans})
    tracks = [f"device {d}" for d in devices] + [f"job {j}" for j in jobs]
    row = {t: i for i, t in enumerate(tracks)}
    cmap = plt.get_cmap("tab10")
    colour = {j: cmap(i % 10) for i, j in enumerate(jobs)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(tracks) + 1.2))
    for s in spans:
        bar = [(s.start_s, max(s.end_s - s.start_s, 1e-3))]
        style: dict[str, Any] = {"color": colour[s.job]}
        if s.kind == "tool":
            style = {"facecolor": "none", "edgecolor": "grey", "hatch": "///"}
        elif s.kind.startswith("swap_to_") or s.kind in ("sleep", "wake"):
            style = {"color": "black"}
        if s.device:
            ax.broken_barh(bar, (row[f"device {s.device}"] - 0.4, 0.8), **style)
        ax.broken_barh(bar, (row[f"job {s.job}"] - 0.4, 0.8), **style)
    ax.set_yticks(range(len(tracks)), tracks, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the coordinator started")
    ax.set_title(
        f"{title}: calls per device and per job (grey hatching: tool waits; black: state moves, engines' sleeps and wakes)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
