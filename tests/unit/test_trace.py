"""Traces: a simulated run written in the Chrome trace event format, checked; the checker refuses
what a viewer would not read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plexrl.sim import JobModel, Lognormal, Simulation
from plexrl.trace import DEVICES_PID, JOBS_PID, Span, check_trace, chrome_trace


def test_a_simulated_run_is_a_valid_trace_with_a_track_per_device_and_per_job() -> None:
    jobs = [JobModel(f"j{i}", steps=3, rollouts=4, turns=2, output_tokens=Lognormal(50, 0.5)) for i in range(3)]
    result = Simulation("plex", 2, jobs, record_timeline=True, seed=1).run()
    trace = json.loads(json.dumps(chrome_trace(result.timeline, "sim")))  # what a file holds
    check_trace(trace)
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "call"]
    assert len(calls) == 2 * len(result.timeline)  # each call on its device's track and its job's
    tracks = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {name for pid, name in tracks if pid == DEVICES_PID} == {s.device for s in result.timeline}
    assert {name for pid, name in tracks if pid == JOBS_PID} == {s.job for s in result.timeline}
    assert {e["name"] for e in calls} >= {"generate", "optim_step"}


def test_a_queued_call_gets_a_queued_span_ending_where_it_starts() -> None:
    trace = chrome_trace([Span("w0", "a-1", "generate", 2.0, 3.5, queued_s=0.5)])
    (queued,) = [e for e in trace["traceEvents"] if e["name"] == "queued"]
    assert (queued["ts"], queued["dur"], queued["pid"]) == (1.5e6, 0.5e6, JOBS_PID)


@pytest.mark.parametrize(
    "bad",
    [
        {"events": []},
        {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 0, "ts": 0}]},  # no dur
        {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": -1}]},
        {"traceEvents": [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {}}]},
        {"traceEvents": [{"ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 1}]},  # no name
        {"traceEvents": [{"name": "x", "ph": "B", "pid": 1, "tid": 0, "ts": 0}]},
    ],
)
def test_the_checker_refuses_what_a_viewer_would_not_read(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        check_trace(bad)


def test_a_span_without_a_device_is_on_its_jobs_track_only() -> None:
    trace = chrome_trace([Span("", "a-1", "tool", 1.0, 1.5), Span("w0", "a-1", "generate", 1.5, 2.0)])
    check_trace(trace)
    tool = [e for e in trace["traceEvents"] if e["name"] == "tool"]
    assert [e["pid"] for e in tool] == [JOBS_PID]
    devices = [
        e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == DEVICES_PID
    ]
    assert devices == ["w0"]
