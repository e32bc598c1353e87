"""The scheduler as a specification: event sequences with the actions they must produce,
then invariants over random event sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.coordinator.scheduler import (
    POLICIES,
    CallCancelled,
    CallFinished,
    CallSubmitted,
    Dispatch,
    Fail,
    JobClosed,
    JobOpened,
    Place,
    Scheduler,
    WorkerJoined,
    WorkerLost,
)
from plexrl.errors import NoWorkersError, WorkerLostError


def run(events: list) -> list:
    s = Scheduler()
    out = []
    for t, e in enumerate(events):
        out.extend(s.handle(e, float(t)))
    return out


def test_jobs_are_placed_on_the_worker_with_fewest_jobs() -> None:
    actions = run([WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a"), JobOpened("b"), JobOpened("c")])
    assert actions == [Place("a", "w0"), Place("b", "w1"), Place("c", "w0")]


def test_opening_a_job_without_workers_fails_with_no_workers() -> None:
    (action,) = run([JobOpened("a")])
    assert isinstance(action, Fail) and action.call_id is None and isinstance(action.error, NoWorkersError)


DISPATCH_ORDER = {
    "a job's calls run one at a time in submission order": [
        WorkerJoined("w0", slots=4),
        JobOpened("a"),
        CallSubmitted(1, "a", "generate"),
        CallSubmitted(2, "a", "forward_backward"),
        CallSubmitted(3, "a", "optim_step"),
        CallFinished(1),
        CallFinished(2),
    ],
    "a busy worker takes the oldest waiting call next": [
        WorkerJoined("w0"),
        JobOpened("a"),
        JobOpened("b"),
        CallSubmitted(1, "a", "generate"),
        CallSubmitted(2, "b", "generate"),
        CallSubmitted(3, "a", "generate"),
        CallFinished(1),
        CallFinished(2),
    ],
}


@pytest.mark.parametrize("events", DISPATCH_ORDER.values(), ids=DISPATCH_ORDER.keys())
def test_calls_are_dispatched_in_order(events: list) -> None:
    actions = run(events)
    assert [a for a in actions if isinstance(a, Dispatch)] == [Dispatch(1, "w0"), Dispatch(2, "w0"), Dispatch(3, "w0")]


def test_a_cancelled_queued_call_never_runs_and_a_cancelled_running_one_runs_to_its_end() -> None:
    actions = run(
        [
            WorkerJoined("w0"),
            JobOpened("a"),
            CallSubmitted(1, "a", "generate"),
            CallSubmitted(2, "a", "sync_weights"),
            CallSubmitted(3, "a", "generate"),
            CallCancelled(2),  # queued: leaves the queue
            CallCancelled(1),  # running: the worker decides; the slot stays taken until it reports
            CallFinished(1),
        ]
    )
    assert [a for a in actions if isinstance(a, Dispatch)] == [Dispatch(1, "w0"), Dispatch(3, "w0")]


def test_losing_a_worker_fails_its_running_and_queued_calls_and_later_ones() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a"), JobOpened("b")]:
        s.handle(e, 0.0)
    assert s.handle(CallSubmitted(1, "a", "generate"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "a", "optim_step"), 0.0) == []
    assert s.handle(CallSubmitted(3, "b", "generate"), 0.0) == [Dispatch(3, "w1")]
    lost = s.handle(WorkerLost("w0", "test"), 1.0)
    assert [(a.call_id, type(a.error)) for a in lost if isinstance(a, Fail)] == [
        (1, WorkerLostError),
        (2, WorkerLostError),
    ]
    (later,) = s.handle(CallSubmitted(4, "a", "generate"), 2.0)
    assert isinstance(later, Fail) and isinstance(later.error, WorkerLostError)
    assert s.handle(CallFinished(1), 2.0) == []  # a late answer from the dead worker is ignored
    assert s.handle(CallFinished(3), 2.0) == []  # job b on w1 is unaffected
    assert s.handle(CallSubmitted(5, "b", "generate"), 2.0) == [Dispatch(5, "w1")]


def test_new_jobs_avoid_a_lost_worker_and_closed_jobs_free_their_place() -> None:
    actions = run(
        [WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a"), JobClosed("a"), WorkerLost("w1", "x"), JobOpened("b")]
    )
    assert [a for a in actions if isinstance(a, Place)] == [Place("a", "w0"), Place("b", "w0")]


def test_busy_seconds_count_only_time_with_a_running_call() -> None:
    s = Scheduler()
    s.handle(WorkerJoined("w0"), 0.0)
    s.handle(JobOpened("a"), 0.0)
    s.handle(CallSubmitted(1, "a", "generate"), 10.0)
    s.handle(CallFinished(1), 13.0)
    s.handle(CallSubmitted(2, "a", "generate"), 20.0)
    assert s.busy_s("w0", 21.0) == 4.0


# -- invariants on random event sequences ------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("join"), st.integers(1, 3)),
    st.tuples(st.just("open"), st.just(0)),
    st.tuples(st.just("submit"), st.integers(0, 9)),
    st.tuples(st.just("finish"), st.integers(0, 99)),
    st.tuples(st.just("lose"), st.integers(0, 9)),
    st.tuples(st.just("cancel"), st.integers(0, 99)),
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80))
def test_invariants_hold_on_random_event_sequences(policy: str, ops: list[tuple[str, int]]) -> None:
    s = Scheduler(policy)
    workers: dict[str, int] = {}  # alive worker -> slots
    homes: dict[str, str] = {}  # job -> home worker
    running: dict[int, tuple[str, str]] = {}  # call -> (job, worker)
    outcome: dict[int, str] = {}  # call -> "dispatched" | "failed" | "cancelled"
    submitted: dict[str, list[int]] = {}
    next_call, n_workers, n_jobs, t = 1, 0, 0, 0.0

    def check(actions: list) -> None:
        for a in actions:
            if isinstance(a, Place):
                assert a.worker_id in workers
                if policy == "dedicated":  # (no job closes in these sequences)
                    assert a.worker_id not in homes.values(), "dedicated: one job per worker"
                homes[a.job_id] = a.worker_id
            elif isinstance(a, Dispatch):
                job = next(j for j, ids in submitted.items() if a.call_id in ids)
                assert a.call_id not in outcome, "a call is dispatched, failed or cancelled exactly once"
                assert homes[job] == a.worker_id, "affinity: calls run on their job's home worker"
                assert all(j != job for j, _ in running.values()), "one call per job at a time"
                earlier = [c for c in submitted[job] if c < a.call_id]
                assert all(c in outcome for c in earlier), "a job's calls start in submission order"
                outcome[a.call_id] = "dispatched"
                running[a.call_id] = (job, a.worker_id)
            elif isinstance(a, Fail) and a.call_id is not None:
                assert outcome.get(a.call_id) not in ("failed", "cancelled")
                outcome[a.call_id] = "failed"
                running.pop(a.call_id, None)
        for w, slots in workers.items():
            assert sum(1 for _, rw in running.values() if rw == w) <= slots, "never over a worker's slots"

    for kind, arg in ops:
        t += 1.0
        if kind == "join":
            w = f"w{n_workers}"
            n_workers += 1
            workers[w] = arg
            check(s.handle(WorkerJoined(w, slots=arg), t))
        elif kind == "open":
            j = f"j{n_jobs}"
            n_jobs += 1
            submitted[j] = []
            check(s.handle(JobOpened(j), t))
        elif kind == "submit" and submitted:
            j = sorted(submitted)[arg % len(submitted)]
            if j not in homes:
                continue
            submitted[j].append(next_call)
            check(s.handle(CallSubmitted(next_call, j, "generate"), t))
            next_call += 1
        elif kind == "finish" and running:
            c = sorted(running)[arg % len(running)]
            del running[c]
            check(s.handle(CallFinished(c), t))
        elif kind == "cancel" and next_call > 1:
            c = 1 + arg % (next_call - 1)
            if c not in outcome:  # still queued: it leaves its queue for good
                outcome[c] = "cancelled"
            check(s.handle(CallCancelled(c), t))  # running, finished or failed: no effect
        elif kind == "lose" and workers:
            w = sorted(workers)[arg % len(workers)]
            del workers[w]
            check(s.handle(WorkerLost(w, "test"), t))
            assert all(rw != w for _, rw in running.values()), "a lost worker's calls are failed"

    # Progress: with the remaining workers alive, finishing whatever runs eventually settles
    # every submitted call of a placed job (none is stuck in a queue).
    for _ in range(next_call):
        if not running:
            break
        c = min(running)
        del running[c]
        t += 1.0
        check(s.handle(CallFinished(c), t))
    for j, ids in submitted.items():
        if j in homes:
            assert all(c in outcome for c in ids), f"job {j} has calls that never ran nor failed"
