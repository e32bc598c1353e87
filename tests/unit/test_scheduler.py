"""The scheduler as a specification: event sequences with the actions they must produce,
then invariants over random event sequences (hypothesis)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from plexrl.coordinator.buckets import Mlfq, Peers, Trajectories, Trajectory, bucket_for
from plexrl.coordinator.events import (
    CallCancelled,
    CallFinished,
    CallSubmitted,
    Dispatch,
    Fail,
    JobClosed,
    JobLost,
    JobOpened,
    JobResumed,
    JobSized,
    MoveWorker,
    OwnCall,
    Place,
    Recover,
    Release,
    ReplicaFailed,
    Replicate,
    Swap,
    SwapDone,
    Tick,
    TurnSignals,
    WorkerJoined,
    WorkerLost,
    WorkerRole,
)
from plexrl.coordinator.policies import POLICIES
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.scheduler import Scheduler
from plexrl.coordinator.scheduler.calls import Calls
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.state import Tables
from plexrl.errors import JobClosedError, JobTooLargeError, NoWorkersError, WorkerLostError
from plexrl.names import ROLES


def run(events: list) -> list:
    s = Scheduler()
    out = []
    for t, e in enumerate(events):
        out.extend(s.handle(e, float(t)))
    return out


def test_jobs_are_placed_on_the_worker_with_fewest_jobs() -> None:
    actions = run([WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a"), JobOpened("b"), JobOpened("c")])
    assert actions == [Place("a", "w0"), Place("b", "w1"), Place("c", "w0")]


def test_a_job_opened_before_any_worker_registered_waits_for_one_then_gives_up() -> None:
    s = Scheduler()
    assert s.handle(JobOpened("a"), 0.0) == [Place("a", "")]
    assert s.handle(CallSubmitted(1, "a", "open"), 0.0) == []
    assert s.handle(WorkerJoined("w0"), 1.0) == [Recover("a", "w0", restore=False), Dispatch(1, "w0")]
    s.handle(JobOpened("b"), 2.0)  # placed on w0 at once
    s.handle(WorkerLost("w0", "test"), 3.0)
    s.handle(JobOpened("c"), 4.0)
    s.handle(CallSubmitted(2, "c", "open"), 4.0)
    (failed,) = [a for a in s.handle(Tick(), 4.0 + s.recovery_wait_s) if isinstance(a, Fail) and a.job_id == "c"]
    assert isinstance(failed.error, NoWorkersError) and "opened with no worker registered" in str(failed.error)


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


G = 10**9
SWAP_BPS = 1e9  # 10 GB of state moves in 10 s


def _two_jobs_one_fits(policy: str, gap_s: float | None) -> list:
    """Jobs a and b (10 GB each) on a worker with room for one; a ran before (its idle gap known
    if ``gap_s``), then b's call arrives while a sits idle."""
    s = Scheduler(policy)
    t = 0.0
    events: list = [
        WorkerJoined("w0", memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS),
        JobOpened("a", 10 * G),
        JobOpened("b", 10 * G),
        CallSubmitted(1, "a", "generate"),
        CallFinished(1),
    ]
    if gap_s is not None:  # a's next call came gap_s after its last one: its expected gap
        events += [CallSubmitted(2, "a", "generate"), CallFinished(2)]
    actions = []
    for e in events:
        t += gap_s if (gap_s is not None and isinstance(e, CallSubmitted) and e.call_id == 2) else 1.0
        actions += s.handle(e, t)
    actions += s.handle(CallSubmitted(3, "b", "generate"), t + 1.0)
    return [a for a in actions if isinstance(a, Swap)]


@pytest.mark.parametrize(
    ("policy", "gap_s", "moved_out"),
    [
        ("fifo", None, True),  # fifo moves the least recently used out at once
        ("plex", None, False),  # a's gap is unknown: moving it could cost more than it saves
        ("plex", 5.0, False),  # a comes back in 5 s, moving it out and in takes 20 s
        ("plex", 100.0, True),  # a is idle for 100 s: moving it pays
    ],
)
def test_state_moves_out_only_when_the_policy_says_it_pays(policy: str, gap_s: float | None, moved_out: bool) -> None:
    swaps = _two_jobs_one_fits(policy, gap_s)
    assert (Swap("a", "w0", "host", 10 * G) in swaps) == moved_out


def test_state_moves_in_only_into_free_room() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", memory_bytes=20 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    assert [type(a) for a in s.handle(JobOpened("a", 20 * G), 0.0)] == [Place]  # fills the device
    s.handle(JobOpened("b", 10 * G), 0.0)  # starts in host memory
    assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "b", "generate"), 1.0) == []  # a runs: nothing can leave
    assert s.handle(CallFinished(1), 2.0) == [Swap("a", "w0", "host", 20 * G)]
    assert s.handle(SwapDone("a", 20.0), 22.0) == [Swap("b", "w0", "device", 10 * G)]
    assert s.handle(SwapDone("b", 10.0), 32.0) == [Dispatch(2, "w0")]


def test_a_waiting_job_forces_a_move_once_it_starves() -> None:
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b", 10 * G), 0.0)
    s.handle(CallSubmitted(1, "a", "generate"), 0.0)
    s.handle(CallFinished(1), 1.0)
    assert s.handle(CallSubmitted(2, "b", "generate"), 2.0) == []  # a's gap unknown: b waits
    assert s.handle(Tick(), 100.0) == []
    actions = s.handle(Tick(), 2.0 + 20 * 10.0)  # the bound: 20 of b's own transfer times
    assert actions == [Swap("a", "w0", "host", 10 * G)]
    assert s.handle(SwapDone("a", 10.0), 215.0) == [Swap("b", "w0", "device", 10 * G)]
    assert s.handle(SwapDone("b", 10.0), 225.0) == [Dispatch(2, "w0")]


def test_generates_vllm_serves_need_no_move_and_leave_the_device_to_training() -> None:
    """On a worker whose sampler keeps its own copy of every job's weights (vLLM), a generate starts
    whether or not its job's state is in, and a job with only generates running is moved out for
    another job's training; on an hf worker the same generate waits for its state."""
    for stateless in (True, False):
        s = Scheduler("fifo")
        s.handle(WorkerJoined("w0", slots=4, memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS,
                              stateless_generates=stateless), 0.0)  # fmt: skip
        s.handle(JobOpened("a", 10 * G), 0.0)  # fills the device
        s.handle(JobOpened("b", 10 * G), 0.0)  # starts in host memory
        assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w0")]
        started = s.handle(CallSubmitted(2, "b", "generate"), 2.0)
        assert started == ([Dispatch(2, "w0")] if stateless else [])
    # b's training needs its state; a only samples, so it moves out meanwhile.
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=4, memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS, stateless_generates=True), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b", 10 * G), 0.0)
    assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "b", "forward_backward"), 2.0) == [Swap("a", "w0", "host", 10 * G)]
    assert s.handle(SwapDone("a", 10.0), 12.0) == [Swap("b", "w0", "device", 10 * G)]
    assert s.handle(SwapDone("b", 10.0), 22.0) == [Dispatch(2, "w0")]
    assert s.handle(CallFinished(1), 23.0) == []  # a's generate ran through both moves
    # a's training waits for its state again.
    assert s.handle(CallSubmitted(3, "a", "forward_backward"), 24.0) == []


def test_plex_starts_the_close_of_a_job_in_host_memory_ahead_of_training() -> None:
    """A close needs no move (it frees the state wherever it is), so it does not rank with the calls
    that wait for one: behind a queue of resident jobs' training it would wait for all of it."""
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", slots=4, memory_bytes=25 * G, swap_bytes_per_s=SWAP_BPS, trainer_slots=1), 0.0)
    for job in ("a", "c", "b"):  # a and c fill the device, b starts in host memory
        s.handle(JobOpened(job, 10 * G), 0.0)
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 1.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "c", "forward_backward"), 2.0) == []  # the trainer is busy
    assert s.handle(CallSubmitted(3, "b", "close"), 3.0) == []
    assert s.handle(CallFinished(1), 4.0) == [Dispatch(3, "w0")]
    assert s.handle(CallFinished(3), 5.0) == [Dispatch(2, "w0")]


def test_plex_counts_a_rollout_on_vllm_as_idle_time_of_the_trainers_state() -> None:
    """The break-even rule's gap, on a worker whose generates use no job state, is the time between
    the job's trainer calls: a job that trains, then samples for 100 s, is worth moving out while it
    samples (counting its generates as use, its gaps would be the 1 s between them)."""
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", slots=4, memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS, stateless_generates=True), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b", 10 * G), 0.0)
    t, call = 0.0, 0
    for _ in range(2):  # train, then a rollout of back-to-back generates
        t, call = t + 1.0, call + 1
        assert s.handle(CallSubmitted(call, "a", "forward_backward"), t) == [Dispatch(call, "w0")]
        s.handle(CallFinished(call), t + 1.0)
        for _ in range(50):
            t, call = t + 2.0, call + 1
            assert s.handle(CallSubmitted(call, "a", "generate"), t) == [Dispatch(call, "w0")]
            s.handle(CallFinished(call), t + 1.0)
    residency = s.residency("a")
    assert residency is not None and residency.expected_gap_s is not None and residency.expected_gap_s > 90
    t, call = t + 2.0, call + 1
    assert s.handle(CallSubmitted(call, "a", "generate"), t) == [Dispatch(call, "w0")]  # a samples on
    assert s.handle(CallSubmitted(call + 1, "b", "forward_backward"), t + 1.0) == [Swap("a", "w0", "host", 10 * G)]


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


def test_a_recoverable_job_moves_to_another_worker_and_runs_its_restore_before_anything_else() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0", slots=2), WorkerJoined("w1", slots=2), JobOpened("a"), JobOpened("b")]:
        s.handle(e, 0.0)
    s.handle(JobSized("a", 0, snapshots=True), 0.0)
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "a", "generate"), 0.0) == [Dispatch(2, "w0")]
    assert s.handle(CallSubmitted(3, "a", "optim_step"), 0.0) == []
    # Nothing failed; a restore of the scheduler's own (id -1) starts on the new home, first.
    assert s.handle(WorkerLost("w0", "test"), 1.0) == [Recover("a", "w1"), Dispatch(-1, "w1", own=RESTORE_A)]
    assert s.handle(CallSubmitted(5, "a", "generate"), 1.0) == []  # behind the restore, like everything
    assert s.handle(CallFinished(-1), 2.0) == [Dispatch(1, "w1"), Dispatch(2, "w1")]  # back in their order
    assert s.handle(CallFinished(2), 2.0) == [Dispatch(5, "w1")]
    assert s.handle(CallFinished(1), 3.0) == [Dispatch(3, "w1")]
    # Its new home lost as well: the next one; with none left, it waits for a worker (its restore
    # pending), takes the next one that joins, and is lost only once none joins in time.
    s.handle(WorkerJoined("w2"), 3.0)
    lost_b = s.handle(WorkerLost("w1", "test"), 4.0)  # b (not recoverable) was there too
    assert lost_b[0] == Recover("a", "w2") and [type(x) for x in lost_b[1:]] == [JobLost, Dispatch]
    assert isinstance(lost_b[1], JobLost) and lost_b[1].job_id == "b"
    assert lost_b[2] == Dispatch(-2, "w2", own=RESTORE_A)
    assert s.handle(WorkerLost("w2", "test"), 5.0) == [Recover("a", "", restore=False)]
    assert s.has_waiting()
    assert s.handle(WorkerJoined("w3"), 6.0) == [Recover("a", "w3", restore=False), Dispatch(-2, "w3", own=RESTORE_A)]
    assert s.handle(WorkerLost("w3", "test"), 7.0) == [Recover("a", "", restore=False)]
    assert s.handle(Tick(), 7.0 + s.recovery_wait_s - 1) == []
    lost = s.handle(Tick(), 7.0 + s.recovery_wait_s)
    assert [(a.call_id, type(a.error)) for a in lost if isinstance(a, Fail)] == [
        (-2, WorkerLostError),
        (3, WorkerLostError),
        (5, WorkerLostError),
    ]
    assert all("no worker could take it over within 300 s" in str(a.error) for a in lost if isinstance(a, Fail))


def test_a_job_resumed_from_the_journal_waits_for_a_worker_and_restores_before_its_calls_run() -> None:
    s = Scheduler()
    assert s.handle(JobResumed("a", 100), 0.0) == [Recover("a", "", restore=False)]  # no worker yet
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 0.5) == []  # its client's calls wait
    assert s.handle(WorkerJoined("w0"), 1.0) == [Recover("a", "w0"), Dispatch(-1, "w0", own=RESTORE_A)]
    assert s.handle(CallFinished(-1), 2.0) == [Dispatch(1, "w0")]
    # No worker within the recovery wait: the resumed job is lost, its calls fail.
    s.handle(JobResumed("b", 100), 3.0)
    s.handle(WorkerLost("w0", "test"), 3.0)
    s.handle(CallSubmitted(3, "b", "generate"), 3.0)
    lost = s.handle(Tick(), 3.0 + s.recovery_wait_s)
    assert {(a.job_id, a.call_id) for a in lost if isinstance(a, Fail)} == {("a", 1), ("b", -2), ("b", 3)}


def test_a_job_whose_worker_died_while_it_opened_opens_on_another() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a")]:
        s.handle(e, 0.0)
    assert s.handle(CallSubmitted(1, "a", "open"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "a", "generate"), 0.0) == []
    assert s.handle(WorkerLost("w0", "test"), 1.0) == [Recover("a", "w1", restore=False), Dispatch(1, "w1")]
    assert s.handle(CallFinished(1), 2.0) == [Dispatch(2, "w1")]


def test_a_job_whose_restore_failed_is_lost_and_its_calls_fail() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("a")]:
        s.handle(e, 0.0)
    s.handle(JobSized("a", 0, snapshots=True), 0.0)
    s.handle(CallSubmitted(1, "a", "optim_step"), 0.0)
    assert s.handle(WorkerLost("w0", "test"), 1.0) == [Recover("a", "w1"), Dispatch(-1, "w1", own=RESTORE_A)]
    lost = s.handle(CallFinished(-1, error="no model at /m"), 2.0)  # the worker could not restore it
    assert [(a.call_id, type(a.error)) for a in lost if isinstance(a, Fail)] == [(1, WorkerLostError)]
    assert "could not be restored on another worker (no model at /m)" in str(lost[0].error)
    (later,) = s.handle(CallSubmitted(3, "a", "generate"), 3.0)
    assert isinstance(later, Fail) and isinstance(later.error, WorkerLostError)


def test_a_job_whose_open_failed_fails_its_other_calls_and_frees_the_worker() -> None:
    """Found by fuzzing the coordinator: the failed open's CallFinished dispatched the job's next
    call, whose slot then leaked once the job was closed, and the worker never ran anything again."""
    s = Scheduler()
    for e in [WorkerJoined("w0"), JobOpened("a"), JobOpened("b")]:
        s.handle(e, 0.0)
    assert s.handle(CallSubmitted(1, "a", "open"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "a", "generate"), 0.0) == []
    assert s.handle(CallSubmitted(3, "b", "open"), 0.0) == []
    failed = s.handle(CallFinished(1, error="no model at /m"), 1.0)
    assert [(a.call_id, type(a.error)) for a in failed if isinstance(a, Fail)] == [(2, JobClosedError)]
    assert [a for a in failed if isinstance(a, Dispatch)] == [Dispatch(3, "w0")]  # b's open, not a's generate
    s.handle(JobClosed("a"), 1.0)
    s.handle(CallFinished(3), 2.0)
    assert s.handle(CallSubmitted(4, "b", "generate"), 2.0) == [Dispatch(4, "w0")]


def test_a_call_finished_after_its_job_was_closed_still_frees_its_slot() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0"), JobOpened("a"), JobOpened("b")]:
        s.handle(e, 0.0)
    assert s.handle(CallSubmitted(1, "a", "generate"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "a", "forward_backward"), 0.0) == []
    closed = s.handle(JobClosed("a"), 1.0)  # e.g. dropped as lost: its calls fail, none is left waiting
    assert [(a.call_id, type(a.error)) for a in closed if isinstance(a, Fail)] == [
        (1, JobClosedError),
        (2, JobClosedError),
    ]
    assert s.handle(CallSubmitted(3, "b", "generate"), 1.0) == [Dispatch(3, "w0")]


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


def test_a_job_that_outgrows_the_budget_when_sized_pushes_idle_state_out_first() -> None:
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", memory_bytes=15 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b"), 0.0)  # size unknown until its open ran
    assert s.handle(CallSubmitted(1, "b", "open"), 1.0) == [Dispatch(1, "w0")]
    # Over the budget now: the idle job's state leaves at once (never the running one's).
    assert s.handle(JobSized("b", 10 * G), 2.0) == [Swap("a", "w0", "host", 10 * G)]
    assert s.used_bytes("w0") == 20 * G
    s.handle(CallFinished(1), 2.0)
    assert s.handle(CallSubmitted(2, "a", "generate"), 2.0) == []  # a waits for its state to come back
    assert s.handle(SwapDone("a", 10.0), 12.0) == []  # no room for a while b is resident
    assert s.used_bytes("w0") == 10 * G


@pytest.mark.parametrize("policy", ["fifo", "plex"])
def test_a_job_placed_while_the_device_is_over_budget_opens_once_there_is_room_without_a_move(policy: str) -> None:
    """Its state does not exist before its open: there is nothing to move in (a move would reach a
    worker that has no such job, fail, and be retried for ever)."""
    s = Scheduler(policy)
    s.handle(WorkerJoined("w0", memory_bytes=10 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    s.handle(JobOpened("a"), 0.0)
    assert s.handle(CallSubmitted(1, "a", "open"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(JobSized("a", 12 * G), 1.0) == []  # over the budget, but a is running
    s.handle(JobOpened("b"), 1.0)
    assert s.handle(CallSubmitted(2, "b", "open"), 1.0) == []  # no room yet, and no Swap of nothing
    assert s.handle(CallFinished(1), 2.0) == [Swap("a", "w0", "host", 12 * G)]
    assert s.handle(SwapDone("a", 1.0), 3.0) == [Dispatch(2, "w0")]


def test_a_failed_move_leaves_the_state_where_it_was() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", memory_bytes=10 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b", 10 * G), 0.0)  # in the host store
    assert s.handle(CallSubmitted(1, "b", "generate"), 1.0) == [Swap("a", "w0", "host", 10 * G)]
    assert s.handle(SwapDone("a", 0.0, ok=False), 2.0) == [Swap("a", "w0", "host", 10 * G)]  # tried again
    residency = s.residency("a")
    assert s.used_bytes("w0") == 10 * G and residency is not None and residency.tier == "to_host"
    assert s.handle(SwapDone("a", 10.0), 12.0) == [Swap("b", "w0", "device", 10 * G)]
    assert s.handle(SwapDone("b", 10.0, ok=False), 22.0) == [Swap("b", "w0", "device", 10 * G)]
    assert s.used_bytes("w0") == 10 * G  # the failed move in gave back its reservation


def test_closing_a_job_needs_no_state_on_the_device() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", memory_bytes=10 * G, swap_bytes_per_s=SWAP_BPS), 0.0)
    s.handle(JobOpened("a", 10 * G), 0.0)
    s.handle(JobOpened("b", 10 * G), 0.0)  # in the host store
    assert s.handle(CallSubmitted(1, "b", "close"), 1.0) == [Dispatch(1, "w0")]
    s.handle(CallFinished(1), 2.0)
    s.handle(JobClosed("b"), 2.0)
    assert s.used_bytes("w0") == 10 * G


def test_plex_runs_stage_unblocking_calls_first_then_the_job_furthest_below_its_fair_share() -> None:
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0"), 0.0)
    for job, weight in (("a", 1.0), ("b", 1.0), ("c", 3.0)):
        s.handle(JobOpened(job, weight=weight), 0.0)
    assert s.handle(CallSubmitted(1, "a", "generate"), 0.0) == [Dispatch(1, "w0")]
    s.handle(CallSubmitted(2, "b", "generate"), 0.0)
    s.handle(CallSubmitted(3, "c", "generate"), 0.0)
    s.handle(CallSubmitted(4, "a", "sync_weights"), 0.0)
    assert s.handle(CallFinished(1), 10.0) == [Dispatch(4, "w0")]  # a's sync unblocks its next stage
    assert s.handle(CallFinished(4), 11.0) == [Dispatch(2, "w0")]  # b and c have had nothing: b is older
    s.handle(CallSubmitted(5, "b", "generate"), 12.0)
    # b has had 10 s (share 10), c none; after c's 30 s c has had 30 / weight 3 = 10 < a's 11:
    assert s.handle(CallFinished(2), 21.0) == [Dispatch(3, "w0")]
    s.handle(CallSubmitted(6, "a", "generate"), 22.0)
    s.handle(CallSubmitted(7, "c", "generate"), 22.0)
    assert s.handle(CallFinished(3), 30.0) == [Dispatch(7, "w0")]  # c: 9/3 = 3 s of share, a 11, b 10


def test_batched_time_is_shared_between_the_calls_that_ran_together() -> None:
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", slots=4), 0.0)
    s.handle(JobOpened("a"), 0.0)
    s.handle(JobOpened("b"), 0.0)
    s.handle(CallSubmitted(1, "a", "generate"), 0.0)
    s.handle(CallSubmitted(2, "b", "generate"), 2.0)  # a alone for 2 s, then both for 2 s
    s.handle(CallFinished(1), 4.0)
    s.handle(CallFinished(2), 5.0)  # b alone for 1 s
    assert s.ledger.accelerator_s("a", 9.0) == pytest.approx(3.0)
    assert s.ledger.accelerator_s("b", 9.0) == pytest.approx(2.0)
    assert s.busy_s("w0", 9.0) == pytest.approx(5.0)


def test_generates_and_training_run_in_lanes_of_their_own_and_barriers_wait_for_both() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=4), 0.0)
    s.handle(JobOpened("a"), 0.0)
    steps = [
        (CallSubmitted(1, "a", "generate"), [Dispatch(1, "w0")]),
        (CallSubmitted(2, "a", "generate"), [Dispatch(2, "w0")]),  # generates overlap
        (CallSubmitted(3, "a", "forward_backward"), [Dispatch(3, "w0")]),  # training beside sampling
        (CallSubmitted(4, "a", "optim_step"), []),  # one trainer-lane call at a time
        (CallSubmitted(5, "a", "sync_weights"), []),
        (CallSubmitted(6, "a", "generate"), []),  # not before the new weights
        (CallFinished(3), [Dispatch(4, "w0")]),
        (CallFinished(4), []),  # the sync waits for the generates that use the old weights
        (CallFinished(1), []),
        (CallFinished(2), [Dispatch(5, "w0")]),
        (CallFinished(5), [Dispatch(6, "w0")]),
    ]
    for t, (event, expected) in enumerate(steps):
        assert s.handle(event, float(t)) == expected, event


def test_frontier_generates_are_admitted_first() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=1), 0.0)
    s.handle(JobOpened("a"), 0.0)
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 0.0) == [Dispatch(1, "w0")]
    s.handle(CallSubmitted(2, "a", "generate", priority=1), 0.0)  # backfill
    s.handle(CallSubmitted(3, "a", "generate", priority=0), 0.0)  # a frontier group
    assert s.handle(CallFinished(1), 1.0) == [Dispatch(3, "w0", 0)]
    assert s.handle(CallFinished(3), 2.0) == [Dispatch(2, "w0", 1)]


def test_a_disaggregated_job_samples_on_another_worker_and_syncs_across_both() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0"), 0.0)
    assert s.handle(JobOpened("solo", disaggregated=True), 0.0)[0].error.code == "no_workers"  # type: ignore[union-attr]
    s.handle(WorkerJoined("w1"), 0.0)
    assert s.handle(JobOpened("a", disaggregated=True), 0.0) == [Place("a", "w0", "w1")]
    assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w1")]
    assert s.handle(CallSubmitted(2, "a", "forward_backward"), 1.0) == [Dispatch(2, "w0")]
    assert s.handle(CallSubmitted(3, "a", "sync_weights"), 1.0) == []
    assert s.handle(CallSubmitted(4, "a", "generate"), 1.0) == []
    assert s.handle(CallFinished(2), 2.0) == []  # the generate on w1 still uses the old weights
    assert s.handle(CallFinished(1), 3.0) == [Dispatch(3, "w0")]  # w1's event starts w0's barrier
    # The sync done on w0: w1 takes the new weights (a call of the scheduler's own, in the sync's
    # place: the generate waits for it), then the generate runs there.
    assert s.handle(CallFinished(3), 4.0) == [Dispatch(-1, "w1", own=OwnCall("a", "set_weights", follows=3))]
    assert s.handle(CallFinished(-1), 4.5) == [Dispatch(4, "w1")]
    lost = s.handle(WorkerLost("w1", "test"), 5.0)  # its sampler worker gone: the job is lost
    assert [(type(a), getattr(a, "call_id", None)) for a in lost] == [(Fail, 4), (JobLost, None)]


def test_losing_a_disaggregated_jobs_sampler_worker_frees_its_home_slot_for_another_job() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=1), 0.0)
    s.handle(WorkerJoined("w1", slots=1), 0.0)
    assert s.handle(JobOpened("d", disaggregated=True), 0.0) == [Place("d", "w0", "w1")]
    assert s.handle(JobOpened("f"), 0.0) == [Place("f", "w1")]
    assert s.handle(JobOpened("g"), 0.0) == [Place("g", "w0")]  # beside d
    assert s.handle(CallSubmitted(1, "d", "forward_backward"), 1.0) == [Dispatch(1, "w0")]  # w0's only slot
    assert s.handle(CallSubmitted(2, "g", "generate"), 1.0) == []  # queued behind it
    lost = s.handle(WorkerLost("w1", "test"), 2.0)  # d's sampler worker: d is lost, its slot on w0 freed
    assert (Fail("d", 1, lost[0].error) in lost) and Dispatch(2, "w0") in lost  # type: ignore[union-attr]


def _evicting_pays(s: Scheduler, swap: Swap, homes: dict[str, str], now: float) -> bool:
    """Plex's rule for moving ``swap.job_id`` out: its expected idle gap exceeds moving it out and
    back (break-even), or a job waiting on that worker has hit its starvation bound."""
    from plexrl.coordinator import residency as rs

    bps = s.bytes_per_s(swap.worker_id)
    victim = s.residency(swap.job_id)
    assert victim is not None
    if victim.expected_gap_s is not None and victim.expected_gap_s > 2 * rs.transfer_s(victim.state_bytes, bps):
        return True
    waiting = [s.residency(j) for j, w in homes.items() if w == swap.worker_id]
    return any(r is not None and rs.starving(r, now, bps) for r in waiting)


# -- invariants on random event sequences ------------------------------------------------------

UNIT = 10 * G  # job states are 0-2 units; device budgets 2-4 units
BPS = UNIT / 10  # a unit moves in 10 s: break-even gaps of 20-40 s, near the gaps these sequences make
KINDS = ("generate", "generate", "generate", "forward_backward", "optim_step", "sync_weights", "load")
BARRIER_KINDS = ("sync_weights", "load", "restore", "open", "set_weights")
FOLLOW_ON = {"open": "open", "sync_weights": "set_weights", "load": "set_weights", "close": "close"}
RESTORE_A = OwnCall("a", "restore")
_submit, _finish, _moved = (
    st.tuples(st.just("submit"), st.integers(0, 10 * len(KINDS) - 1)),
    st.tuples(st.just("finish"), st.integers(0, 99)),
    st.tuples(st.just("moved"), st.integers(0, 9)),
)
op = st.one_of(  # submits, finishes and transfers weighted up, so devices fill and state moves
    st.tuples(st.just("join"), st.integers(1, 3)),
    st.tuples(st.just("vjoin"), st.integers(1, 3)),  # a worker whose sampler keeps its own weights (vLLM)
    st.tuples(st.just("rollout"), st.integers(0, 5)),  # a rollout worker joins: bucket 0-2, 1-2 slots
    st.tuples(st.just("role"), st.integers(0, 29)),  # a worker changes role (Libra's elastic roles)
    st.tuples(
        st.just("open"), st.integers(0, 15)
    ),  # size 0-2 units; 3-5: disaggregated; 6-11: recoverable; 12-15: pooled
    st.tuples(st.just("turn"), st.integers(0, 999)),  # a pooled job's next turn of one of its trajectories
    st.tuples(st.just("turn"), st.integers(0, 999)),
    st.tuples(st.just("resume"), st.integers(0, 2)),  # a recoverable job from a restarted coordinator's journal
    _submit,
    _submit,
    _submit,
    _finish,
    _finish,
    _moved,
    _moved,
    st.tuples(st.just("lose"), st.integers(0, 9)),
    st.tuples(st.just("close"), st.integers(0, 9)),
    st.tuples(st.just("cancel"), st.integers(0, 99)),
    st.tuples(st.just("fail"), st.integers(0, 99)),  # the worker failed the call (a failed restore ends its job)
    st.tuples(st.just("tick"), st.integers(1, 300)),
)


_turn = st.tuples(st.just("turn"), st.integers(0, 999))
libra_op = st.one_of(  # pooled jobs' turns on rollout workers of a few buckets, workers changing roles
    st.tuples(st.just("join"), st.integers(1, 3)),
    st.tuples(st.just("rollout"), st.integers(0, 5)),
    st.tuples(st.just("rollout"), st.integers(0, 5)),
    st.tuples(st.just("role"), st.integers(0, 29)),
    st.tuples(st.just("switched"), st.integers(0, 9)),
    st.tuples(st.just("open"), st.integers(12, 15)),
    st.tuples(st.just("open"), st.integers(0, 15)),
    *[_turn] * 4,
    *[_finish] * 4,
    _submit,
    _moved,
    st.tuples(st.just("lose"), st.integers(0, 9)),
    st.tuples(st.just("close"), st.integers(0, 9)),
    st.tuples(st.just("tick"), st.integers(1, 300)),
)


@pytest.mark.parametrize("policy", POLICIES)
# Derandomized: CI tries the same sequences every run. And a sequence a random run found: a pooled
# turn waits for a rollout worker moving to training, whose switch the progress phase answers once
# the scheduler sends its MoveWorker (before, the model left such a move unsettled forever and the
# turn looked lost).
@settings(max_examples=1000, deadline=None, derandomize=True)
@given(ops=st.lists(libra_op, min_size=30, max_size=80))
@example(ops=[*[("join", 1)] * 7, ("rollout", 0), *[("role", 0)] * 3, *[("open", 12)] * 5, *[("lose", 0)] * 7,
              ("join", 1), ("join", 1), ("role", 0), ("role", 10), ("open", 12), ("turn", 5), ("tick", 1)])  # fmt: skip
def test_invariants_hold_with_buckets_and_roles(policy: str, ops: list[tuple[str, int]]) -> None:
    check_invariants(policy, ops, rebalance=True)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=1500, deadline=None)
@given(ops=st.lists(op, max_size=80))
# Always tried besides the random ones: a sync_weights (KINDS[5]) submitted while a generate runs
# on a worker with a free slot (random sequences rarely keep a generate running that long).
@example(ops=[("join", 2), ("open", 0), ("submit", 0), ("submit", 50), ("finish", 0)])
# And: a disaggregated job's sampler worker lost while the job holds its home's only slot, another
# job's generate queued there (the freed slot must start it).
@example(ops=[("join", 1), ("join", 1), ("open", 3), ("open", 0), ("open", 0), ("submit", 30), ("submit", 2),
              ("lose", 1)])  # fmt: skip
# And: dedicated, two jobs opened before any worker; the first closes and the second must then
# open on a worker (found by hypothesis: it was placed on a worker where nothing started it).
@example(ops=[("open", 0), ("open", 0), ("join", 1), ("finish", 0), ("close", 0), ("join", 1)])
# And: a worker homing a resumed job's state moves to rollout; a pooled job's turn then waits there
# for its replica's room, which only that idle state leaving frees (found by a random CI run).
@example(ops=[("join", 1), ("join", 1), ("resume", 2), ("role", 10), ("open", 13), ("turn", 0)])
def test_invariants_hold_on_random_event_sequences(policy: str, ops: list[tuple[str, int]]) -> None:
    check_invariants(policy, ops)


def check_invariants(policy: str, ops: list[tuple[str, int]], rebalance: bool = False) -> None:
    """Run ``ops`` through a scheduler (``rebalance``: with a rebalancer moving workers between
    roles) and hold every action to the invariants (AssertionError if not)."""
    # Joins (rollout workers training a job, scheduler/elastic.py) have an invariant test of their own.
    s = Scheduler(policy, rebalancer=Rebalancer(prior_move_s=1.0, join=False) if rebalance else None)
    switching: dict[str, str] = {}  # drained worker -> the role its MoveWorker switches it to
    workers: dict[str, tuple[int, int]] = {}  # alive worker -> (slots, memory budget)
    roles: dict[str, tuple[str, int]] = {}  # alive worker -> (role, bucket)
    stateless: set[str] = set()  # workers whose generates need no job's state (vLLM)
    pooled: set[str] = set()
    turn_of: dict[int, str] = {}  # a pooled job's generate -> its trajectory
    last_turn: dict[tuple[str, str], int] = {}  # (job, trajectory) -> its latest turn (call id)
    turns: dict[tuple[str, str], int] = {}  # (job, trajectory) -> turns submitted
    levels: dict[tuple[str, str], int] = {}  # (job, trajectory) -> its level at its last dispatch
    homes: dict[str, str] = {}  # job -> home worker
    sizes: dict[str, int] = {}  # job -> state bytes
    resident: dict[str, bool] = {}  # job -> its state is on its home device (as the actions say)
    device: dict[str, int] = {}  # worker -> bytes on the device or reserved for a move in
    moving: dict[str, tuple[str, str]] = {}  # worker -> (job, "device" | "host") in transit
    running: dict[int, tuple[str, str]] = {}  # call -> (job, worker)
    outcome: dict[int, str] = {}  # call -> "dispatched" | "failed" | "cancelled"
    submitted: dict[str, list[int]] = {}
    kinds: dict[int, str] = {}  # call -> kind
    samplers: dict[str, str] = {}  # job -> the worker its generates run on
    seq: dict[int, int] = {}  # call -> its place in its job's order (a restore goes first)
    recoverable: set[str] = set()
    replicas: dict[tuple[str, str], int] = {}  # (rollout worker, pooled job) holding a replica -> its bytes
    follow_owed: dict[str, int] = {}  # disaggregated job -> its barrier whose follow-on is not seen yet
    follow_ons: set[int] = set()  # the scheduler's own calls that carry on a barrier on a sampler worker
    owed: collections.Counter[str] = collections.Counter()  # job -> restores the scheduler queued, not yet seen
    opening: list[str] = []  # jobs placed on no worker (none registered): their client's open follows the Place
    next_call, n_workers, n_jobs, t = 1, 0, 0, 0.0

    def submit(job: str, kind: str, priority: int = 0, front: bool = False, signals: TurnSignals | None = None) -> None:
        nonlocal next_call
        c = next_call
        next_call += 1
        submitted[job].append(c)
        kinds[c] = kind
        seq[c] = -c if front else c
        traj = turn_of.get(c, "")
        event = CallSubmitted(
            c, job, kind, priority=priority, front=front, trajectory=traj, signals=signals or TurnSignals()
        )
        check(s.handle(event, t))

    def learn_own(c: int, own: OwnCall) -> None:
        """A call of the scheduler's own, seen for the first time: a restore it queued on a Recover,
        ahead of every call of its job; or a disaggregated job's follow-on, in the place of the
        barrier it carries on."""
        assert c < 0, "its own calls have negative ids"
        if own.follows:
            assert follow_owed.pop(own.job_id, None) == own.follows, "a follow-on carries on the barrier just done"
            assert own.kind == FOLLOW_ON[kinds[own.follows]]
            seq[c] = seq[own.follows]
            follow_ons.add(c)
        else:
            assert own.kind == "restore" and owed[own.job_id] > 0, "its other calls are the restores it owes"
            owed[own.job_id] -= 1
            seq[c] = min((seq[x] for x in submitted[own.job_id]), default=0) - 1
        submitted[own.job_id].append(c)
        kinds[c] = own.kind

    def finish(c: int, error: str = "") -> None:
        """A call's end; a disaggregated job's barrier that ends well is owed a follow-on."""
        job = next(j for j, ids in submitted.items() if c in ids)
        disaggregated = samplers[job] not in ("", homes[job])
        if not error and c > 0 and kinds[c] in FOLLOW_ON and disaggregated and samplers[job] in workers:
            follow_owed[job] = c
        check(s.handle(CallFinished(c, error=error), t))

    def check(actions: list) -> None:
        # Workers the rebalancer is moving between roles (draining, or switching): the scheduler's own
        # record, as no action announces a move before its worker has drained.
        moves = {w.worker_id: w.moving_to for w in s.workers() if w.moving_to}
        for i, a in enumerate(actions):
            if isinstance(a, Place) and not a.worker_id:  # no worker registered: it waits for one
                assert all(role == "rollout" or moves.get(w) == "rollout" for w, (role, _) in roles.items()), (
                    "it waits only with no worker for homes (all take rollout turns, or are moving there)"
                )
                homes[a.job_id] = samplers[a.job_id] = ""
                resident[a.job_id] = False
                opening.append(a.job_id)
            elif isinstance(a, Place):
                assert a.worker_id in workers
                assert roles[a.worker_id][0] != "rollout", "no job's home on a rollout worker"
                assert moves.get(a.worker_id) != "rollout", "no new home on a worker moving to rollout"
                if policy == "dedicated":
                    assert a.worker_id not in homes.values(), "dedicated: one job per worker (closed ones gone)"
                homes[a.job_id] = a.worker_id
                samplers[a.job_id] = a.sampler_id or a.worker_id
                assert a.sampler_id in ("", *workers) and a.sampler_id != a.worker_id
                # Where its state starts is the scheduler's call (room it keeps for a pending restore
                # counts); the budget check below holds it to the sum.
                placed_at = s.residency(a.job_id)
                fits = placed_at is not None and placed_at.tier == "device"
                resident[a.job_id] = fits
                device[a.worker_id] = device.get(a.worker_id, 0) + (sizes[a.job_id] if fits else 0)
            elif isinstance(a, Recover):
                opens = [c for c in submitted[a.job_id] if kinds[c] == "open" and (c not in outcome or c in running)]
                assert a.job_id in recoverable or opens, "only recoverable or opening jobs move"
                assert a.worker_id in ("", *workers) and a.worker_id != homes[a.job_id]
                assert not a.worker_id or roles[a.worker_id][0] != "rollout", "no job's home on a rollout worker"
                homes[a.job_id] = samplers[a.job_id] = a.worker_id  # "": it waits for a worker to join
                resident[a.job_id] = False  # its restore makes the state there
                pending = [
                    c for c in submitted[a.job_id] if kinds[c] == "restore" and (c not in outcome or c in running)
                ]
                assert a.restore == (bool(a.worker_id) and not pending and not owed[a.job_id] and not opens), (
                    "one restore at a time, on a worker; none for a job that still opens"
                )
                for c in [c for c, (j, w) in running.items() if j == a.job_id and w not in workers]:
                    del running[c], outcome[c]  # queued again, for its new home
                owed[a.job_id] += a.restore  # the scheduler queued a restore of its own
            elif isinstance(a, Dispatch):
                if a.own is not None and a.call_id not in kinds:
                    learn_own(a.call_id, a.own)
                job = next(j for j, ids in submitted.items() if a.call_id in ids)
                kind = kinds[a.call_id]
                assert a.call_id not in outcome, "a call is dispatched, failed or cancelled exactly once (per home)"
                rollout = sorted({b for w, (r, b) in roles.items() if r == "rollout" and w not in moves})
                if job in pooled and kind == "generate" and rollout:  # a turn, on the rollout workers
                    level = 0  # a generate outside any trajectory
                    if a.call_id in turn_of:
                        key = (job, turn_of[a.call_id])
                        traj = s.trajectories.get(*key)
                        assert traj is not None and last_turn[key] == a.call_id
                        assert traj.level >= levels.get(key, 0), "a trajectory's level never goes back up the queue"
                        level = levels[key] = traj.level
                    assert a.worker_id not in moves, "a worker moving between roles takes no turn"
                    preferred = bucket_for(level, rollout)
                    role, bucket = roles[a.worker_id]
                    assert role == "rollout" and bucket <= preferred, (
                        "a turn runs on a rollout worker of the bucket serving its trajectory's level (or below)"
                    )
                    if bucket < preferred:
                        full = [
                            sum(1 for _, rw in running.values() if rw == w) >= workers[w][0]
                            for w, (r, b) in roles.items()
                            if r == "rollout" and b == preferred and w not in moves
                        ]
                        assert all(full), "a turn goes to a lower bucket only while every worker of its own is full"
                    on_home = False
                else:
                    on_home = (kind != "generate" and a.call_id not in follow_ons) or samplers[job] == homes[job]
                    assert a.worker_id == (homes[job] if on_home else samplers[job]), (
                        "affinity: each lane on its worker"
                    )
                if kind in ("restore", "open") and on_home:  # it makes the state on the device, in room kept for it
                    resident[job] = True
                    device[a.worker_id] = device.get(a.worker_id, 0) + sizes[job]
                assert resident[job] or not on_home or (kind == "generate" and a.worker_id in stateless), (
                    "a call on the home worker runs only with the state there (but a generate vLLM serves)"
                )
                earlier = [c for c in submitted[job] if seq[c] < seq[a.call_id]]
                settled = [c in outcome and c not in running for c in earlier]
                if kind in BARRIER_KINDS:
                    assert all(settled), "a barrier waits for every earlier call of its job"
                else:
                    assert all(ok for c, ok in zip(earlier, settled, strict=True) if kinds[c] in BARRIER_KINDS), (
                        "no call passes an unfinished barrier"
                    )
                role_now = (roles[a.worker_id][0], moves.get(a.worker_id, ""))
                turns_here = any(kinds[c] == "generate" and w == a.worker_id for c, (_, w) in running.items())
                trainer_lane = kind != "generate" and a.call_id not in follow_ons
                assert a.exclusive == (trainer_lane and "train" in role_now and turns_here), (
                    "a trainer call on a worker taken back from rollout pauses the turns left there; nothing else does"
                )
                if trainer_lane:
                    others = [
                        c
                        for c, (j, _) in running.items()
                        if j == job and kinds[c] != "generate" and c not in follow_ons
                    ]
                    assert not others, "one trainer-lane call per job at a time"
                    assert all(c in outcome for c in earlier if kinds[c] != "generate"), "trainer lane in order"
                outcome[a.call_id] = "dispatched"
                running[a.call_id] = (job, a.worker_id)
            elif isinstance(a, Swap):
                assert a.worker_id not in moving, "one transfer at a time per worker"
                # On a worker lent to rollout, an idle home's state also gives way to a turn's replica.
                if policy == "plex" and a.to == "host" and roles[a.worker_id][0] != "rollout":
                    assert _evicting_pays(s, a, homes, t), (
                        "plex moved state out that neither pays nor unblocks a starving job"
                    )
                assert homes[a.job_id] == a.worker_id
                # A pooled turn uses the sampler's copy of the adapter, never the trainer's state: moving
                # that in beside one is safe (moving it out is not done, to keep the two apart). A
                # generate on a worker whose sampler keeps its own weights uses none of it either way.
                assert all(
                    j != a.job_id
                    or w != a.worker_id
                    or (kinds[c] == "generate" and (w in stateless or (a.to == "device" and j in pooled)))
                    for c, (j, w) in running.items()
                ), "never move the state of a job with a call running on that worker"
                moving[a.worker_id] = (a.job_id, a.to)
                if a.to == "device":
                    device[a.worker_id] += sizes[a.job_id]
                else:
                    resident[a.job_id] = False
            elif isinstance(a, Replicate):
                assert a.job_id in pooled and a.worker_id != homes[a.job_id], "replicas: of pooled jobs, not at home"
                assert a.open == ((a.worker_id, a.job_id) not in replicas), "a replica opens once per worker"
                turn = actions[i + 1] if i + 1 < len(actions) else None
                assert isinstance(turn, Dispatch) and turn.worker_id == a.worker_id, "a replica goes ahead of a turn"
                assert kinds[turn.call_id] == "generate" and turn.call_id in submitted[a.job_id]
                if a.open:  # what it holds counts against the worker's budget until it is released
                    replicas[a.worker_id, a.job_id] = a.weight_bytes
                    device[a.worker_id] = device.get(a.worker_id, 0) + a.weight_bytes
            elif isinstance(a, Release):
                assert a.worker_id in workers
                device[a.worker_id] -= replicas.pop((a.worker_id, a.job_id), 0)
            elif isinstance(a, MoveWorker):
                assert a.worker_id in workers and a.worker_id not in switching, "one move at a time, of a live worker"
                assert a.role != roles[a.worker_id][0] and moves.get(a.worker_id) == a.role
                turns_left = any(rw == a.worker_id and kinds[c] == "generate" for c, (_, rw) in running.items())
                assert a.role == "rollout" or not turns_left, "a worker switches to training once its turns ended"
                switching[a.worker_id] = a.role
            elif isinstance(a, Fail) and a.call_id is not None:
                if a.call_id < 0 and a.call_id not in kinds:  # its own call, failed before it started
                    if a.job_id not in submitted:  # its job was closed (with no home, so no close call)
                        owed[a.job_id] -= 1
                        continue
                    follows = follow_owed.get(a.job_id, 0)
                    kind = FOLLOW_ON[kinds[follows]] if follows else "restore"
                    learn_own(a.call_id, OwnCall(a.job_id, kind, follows=follows))
                assert outcome.get(a.call_id) not in ("failed", "cancelled")
                outcome[a.call_id] = "failed"
                running.pop(a.call_id, None)
        for w, (slots, memory) in workers.items():
            assert sum(1 for _, rw in running.values() if rw == w) <= slots, "never over a worker's slots"
            assert device.get(w, 0) <= memory, "never over a device's memory budget"

    def moved(w: str) -> None:
        job, to = moving.pop(w)
        if to == "device":
            resident[job] = True
        else:
            device[w] -= sizes[job]
        check(s.handle(SwapDone(job, sizes[job] / BPS), t))  # at the declared bandwidth

    for kind, arg in ops:
        t += 1.0
        if kind in ("join", "vjoin"):
            w = f"w{n_workers}"
            n_workers += 1
            workers[w] = (arg, (1 + arg % 2) * UNIT)  # room for one or two big jobs
            roles[w] = ("both", 0)
            if kind == "vjoin":
                stateless.add(w)
            joined = WorkerJoined(
                w,
                slots=arg,
                memory_bytes=(1 + arg % 2) * UNIT,
                swap_bytes_per_s=BPS,
                stateless_generates=w in stateless,
            )
            check(s.handle(joined, t))
        elif kind == "rollout":
            w = f"w{n_workers}"
            n_workers += 1
            workers[w], roles[w] = (1 + arg // 3, UNIT), ("rollout", arg % 3)
            check(s.handle(WorkerJoined(w, slots=1 + arg // 3, memory_bytes=UNIT, role="rollout", bucket=arg % 3), t))
        elif kind == "role" and workers:
            w = sorted(workers)[arg % len(workers)]
            roles[w] = (ROLES[arg // 10], roles[w][1])
            switching.pop(w, None)  # an operator's order overrides a move
            check(s.handle(WorkerRole(w, ROLES[arg // 10]), t))
        elif kind == "switched" and switching:  # a move's worker drained and switched
            w = sorted(switching)[arg % len(switching)]
            roles[w] = (switching.pop(w), roles[w][1])
            check(s.handle(WorkerRole(w, roles[w][0], seconds=1.0 + arg), t))
        elif kind == "turn" and pooled & homes.keys():
            j = sorted(pooled & homes.keys())[arg % len(pooled & homes.keys())]
            key = (j, f"t{arg % 3}")
            if key in last_turn and (last_turn[key] not in outcome or last_turn[key] in running):
                continue  # an agent submits a trajectory's next turn once its last one is done
            n = turns[key] = turns.get(key, 0) + 1
            last_turn[key] = next_call
            turn_of[next_call] = key[1]
            submit(
                j,
                "generate",
                signals=TurnSignals(turn=n - 1, tool_errors=(arg // 3) % 3, tokens=arg, token_budget=1000),
            )
        elif kind == "open":
            j = f"j{n_jobs}"
            n_jobs += 1
            submitted[j], sizes[j] = [], (arg % 3) * UNIT
            if arg >= 12:
                pooled.add(j)
            check(s.handle(JobOpened(j, sizes[j], disaggregated=3 <= arg < 6, pooled=arg >= 12), t))
            if arg >= 6 and homes.get(j):  # its open reported a snapshot-taking job
                recoverable.add(j)
                check(s.handle(JobSized(j, sizes[j], snapshots=True), t))
        elif kind == "resume":
            j = f"j{n_jobs}"
            n_jobs += 1
            submitted[j], sizes[j] = [], arg * UNIT
            recoverable.add(j)
            homes[j] = samplers[j] = "journal"  # on no worker: a Recover places it
            resident[j] = False
            check(s.handle(JobResumed(j, sizes[j]), t))
        elif kind == "submit" and submitted:
            j = sorted(submitted)[arg % len(submitted)]
            if j not in homes:
                continue
            submit(j, KINDS[arg // 10], priority=arg % 2)
        elif kind in ("finish", "fail") and running:
            c = sorted(running)[arg % len(running)]
            del running[c]
            finish(c, error="failed" if kind == "fail" else "")
        elif kind == "cancel" and next_call > 1:
            c = 1 + arg % (next_call - 1)
            if kinds[c] in ("restore", "open"):
                continue  # the server never cancels these (a restore is its own; an open is not cancellable)
            if c not in outcome:  # still queued: it leaves its queue for good
                outcome[c] = "cancelled"
            check(s.handle(CallCancelled(c), t))  # running, finished or failed: no effect
        elif kind == "moved" and moving:
            moved(sorted(moving)[arg % len(moving)])
        elif kind == "tick":
            t += arg
            check(s.handle(Tick(), t))
        elif kind == "close" and homes:
            j = sorted(homes)[arg % len(homes)]
            if any(c not in outcome or c in running for c in submitted[j]) or any(mj == j for mj, _ in moving.values()):
                continue  # a script closes a job once its calls are settled
            if j in follow_owed:
                continue  # (its last call's caller has not heard yet)
            if resident.get(j) and homes[j] in workers:
                device[homes[j]] -= sizes[j]
            del homes[j], submitted[j]
            check(s.handle(JobClosed(j), t))
        elif kind == "lose" and workers:
            w = sorted(workers)[arg % len(workers)]
            del workers[w], roles[w]
            for held in [held for held in replicas if held[0] == w]:
                del replicas[held]
            moving.pop(w, None)
            switching.pop(w, None)
            for c in [c for c, (j, rw) in running.items() if rw == w and j in pooled and homes[j] != w]:
                del running[c], outcome[c]  # a pooled turn on a rollout worker: queued again, without an action
            check(s.handle(WorkerLost(w, "test"), t))
            assert all(rw != w for _, rw in running.values()), "a lost worker's calls are failed or queued again"
        while opening:  # and the open of a job placed before any worker registered
            submit(opening.pop(0), "open")

    # Progress: with the remaining workers alive, finishing what runs, completing transfers and role
    # switches, and letting time pass (ticks) settles every submitted call of a
    # placed job within a bound.
    for _ in range(20 * next_call + 20):
        if running:
            c = min(running)
            del running[c]
            t += 1.0
            finish(c)
        elif moving:
            t += 1.0
            moved(min(moving))
        elif switching:  # a drained worker's switch ends
            w = min(switching)
            roles[w] = (switching.pop(w), roles[w][1])
            check(s.handle(WorkerRole(w, roles[w][0], seconds=1.0), t))
        else:
            t += 1000.0  # past any starvation bound
            check(s.handle(Tick(), t))
    for j, ids in submitted.items():
        if j in homes and homes[j] in workers:
            assert all(c in outcome for c in ids), f"job {j} has calls that never ran nor failed"
            assert not owed[j], f"job {j} has a restore that never ran nor failed"
            assert j not in follow_owed, f"job {j} has a follow-on that never ran nor failed"


def test_plex_packs_jobs_of_one_base_together_and_opens_a_device_only_when_the_others_are_full() -> None:
    s = Scheduler("plex")
    for w in ("w0", "w1", "w2"):
        s.handle(WorkerJoined(w, slots=4), 0.0)
    placed = [s.handle(JobOpened(j, base=b), 0.0)[0] for j, b in [("a", "x"), ("b", "y"), ("c", "x"), ("d", "x")]]
    # b's base differs: a device of its own; c joins a (same base, room for two jobs' expected load);
    # d finds a's device full and b's on another base: the last device.
    assert placed == [Place("a", "w0"), Place("b", "w1"), Place("c", "w0"), Place("d", "w2")]
    (e,) = s.handle(JobOpened("e", base="z"), 0.0)  # no device has room: the least loaded one
    assert e == Place("e", "w1")


def test_with_room_nowhere_a_job_joins_the_least_loaded_worker_of_its_base() -> None:
    s = Scheduler("plex")
    for w in ("w0", "w1", "w2"):
        s.handle(WorkerJoined(w, slots=4), 0.0)
    jobs = [("a", "x"), ("b", "y"), ("c", "z"), ("d", "x"), ("e", "y"), ("f", "z")]
    placed = [s.handle(JobOpened(j, base=base), 0.0)[0].worker_id for j, base in jobs]
    assert placed == ["w0", "w1", "w2", "w0", "w1", "w2"]  # every device full: two jobs' expected load
    (g,) = s.handle(JobOpened("g", base="y"), 0.0)
    assert g == Place("g", "w1")  # as loaded as the others, and it shares its decode steps' weight reads


@pytest.mark.parametrize(("policy", "next_call"), [("fifo", 2), ("plex", 3)])
def test_a_worker_trains_one_call_at_a_time_and_the_policy_picks_the_next(policy: str, next_call: int) -> None:
    """A worker's trainer runs one call at a time (generates overlap beside it): fifo takes the
    oldest training call next, plex one that unblocks a job's next stage."""
    s = Scheduler(policy)
    s.handle(WorkerJoined("w0", slots=8, trainer_slots=1), 0.0)
    for job in "abc":
        s.handle(JobOpened(job), 0.0)
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 0.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "b", "forward_backward"), 0.0) == []  # the trainer is busy
    assert s.handle(CallSubmitted(3, "c", "optim_step"), 0.0) == []
    assert s.handle(CallSubmitted(4, "b", "generate"), 0.0) == [Dispatch(4, "w0")]  # sampling overlaps
    assert s.handle(CallFinished(1), 1.0) == [Dispatch(next_call, "w0")]


@pytest.mark.parametrize("background", [False, True])
def test_an_open_takes_a_trainer_slot_only_on_a_worker_that_opens_on_its_main_thread(background: bool) -> None:
    """Opening a job loads a base and may start an engine (minutes on a GPU): a worker that opens
    beside its other calls says so, and another job's training goes on meanwhile."""
    s = Scheduler()
    s.handle(WorkerJoined("w0", slots=8, trainer_slots=1, background_calls=("open",) if background else ()), 0.0)
    s.handle(JobOpened("a"), 0.0)
    s.handle(JobOpened("b"), 0.0)
    assert s.handle(CallSubmitted(1, "b", "open"), 0.0) == [Dispatch(1, "w0")]
    trains = s.handle(CallSubmitted(2, "a", "forward_backward"), 0.0)
    assert trains == ([Dispatch(2, "w0")] if background else [])
    assert s.handle(CallSubmitted(3, "b", "forward_backward"), 0.0) == []  # b's own calls wait for its open
    finished = s.handle(CallFinished(1), 1.0)
    assert finished == ([] if background else [Dispatch(2, "w0")])


@pytest.mark.parametrize("policy", ["fifo", "plex"])
def test_a_closing_job_is_never_moved_out(policy: str) -> None:
    """The server handles a close's CallFinished before its JobClosed: in between, the closed job
    looks idle and resident, and must not be picked to make room (its worker no longer has it)."""
    s = Scheduler(policy)
    s.handle(WorkerJoined("w0", slots=4, memory_bytes=G), 0.0)
    s.handle(JobOpened("a", G), 0.0)
    s.handle(JobOpened("b", G), 0.0)  # in the host store: no room
    s.handle(CallSubmitted(1, "a", "close"), 1.0)
    s.handle(CallSubmitted(2, "b", "generate"), 1.0)
    assert s.handle(CallFinished(1), 2.0) == []  # a is closed on its worker: nothing to move out
    assert s.handle(Tick(), 100.0) == []  # not even once b starves
    assert s.handle(JobClosed("a"), 100.0) == [Swap("b", "w0", "device", G)]


# -- Libra: buckets and roles ------------------------------------------------------------------


def _pool(*buckets: int, slots: int = 2) -> Scheduler:
    """A train worker w0 holding pooled job "a", and a rollout worker per bucket (r0, r1, ...)."""
    s = Scheduler("fifo", mlfq=Mlfq(service_s=(10.0,), turns_per_level=2))
    s.handle(WorkerJoined("w0"), 0.0)
    for i, b in enumerate(buckets):
        s.handle(WorkerJoined(f"r{i}", slots=slots, role="rollout", bucket=b), 0.0)
    assert s.handle(JobOpened("a", pooled=True), 0.0) == [Place("a", "w0")]
    return s


def test_a_rollout_worker_gets_a_replica_and_each_new_version_of_the_weights_just_ahead_of_a_turn() -> None:
    s = _pool(0, 0, slots=1)
    s.handle(JobSized("a", 16 * G), 0.0)
    first = s.handle(CallSubmitted(1, "a", "generate", trajectory="t"), 0.0)  # the job's initial weights
    assert first == [Replicate("r0", "a", open=True, weights=False, weight_bytes=2 * G), Dispatch(1, "r0")]
    s.handle(CallFinished(1), 1.0)
    assert s.handle(CallSubmitted(2, "a", "generate", trajectory="t"), 1.0) == [Dispatch(2, "r0")]  # has them
    s.handle(CallFinished(2), 2.0)
    assert s.handle(CallSubmitted(3, "a", "sync_weights"), 2.0) == [Dispatch(3, "w0")]
    s.handle(CallFinished(3), 3.0)
    # New weights: the next turn there gets them first; r1, new, gets a replica and them.
    again = s.handle(CallSubmitted(4, "a", "generate", trajectory="t"), 3.0)
    assert again == [Replicate("r0", "a", open=False, weights=True, weight_bytes=2 * G), Dispatch(4, "r0")]
    fresh = s.handle(CallSubmitted(5, "a", "generate", trajectory="u"), 3.0)
    assert fresh == [Replicate("r1", "a", open=True, weights=True, weight_bytes=2 * G), Dispatch(5, "r1")]
    # r1 could not take them: it gets them again before its next turn of the job (and frees what it holds).
    assert s.handle(ReplicaFailed("r1", "a"), 3.5) == [Release("r1", "a")]
    s.handle(CallFinished(4), 4.0)
    s.handle(CallFinished(5), 4.0)
    retry = s.handle(CallSubmitted(6, "a", "generate", trajectory="u"), 4.0)
    assert retry[0] == Replicate("r1", "a", open=True, weights=True, weight_bytes=2 * G)
    s.handle(CallFinished(6), 5.0)
    # The job closes: its replicas go.
    assert s.handle(JobClosed("a"), 6.0) == [Release("r0", "a"), Release("r1", "a")]


def test_a_rollout_workers_replicas_count_against_its_budget_and_the_least_recently_used_idle_one_gives_way() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=4), 0.0)
    s.handle(WorkerJoined("r0", slots=3, role="rollout", memory_bytes=5 * G), 0.0)  # room for two replicas of 2 GB
    for i, job in enumerate("abc"):
        s.handle(JobOpened(job, state_bytes=16 * G, pooled=True), 0.0)
        s.handle(CallSubmitted(10 * i + 1, job, "open"), 0.0)
        s.handle(CallFinished(10 * i + 1), 0.0)
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="t"), 1.0)) == [Dispatch(2, "r0")]
    assert _routing(s.handle(CallSubmitted(12, "b", "generate", trajectory="t"), 2.0)) == [Dispatch(12, "r0")]
    assert s.used_bytes("r0") == 4 * G
    s.handle(CallFinished(2), 3.0)
    s.handle(CallFinished(12), 4.0)
    # c's replica needs room: a's, used least recently and idle, is released for it (b's stays).
    third = s.handle(CallSubmitted(22, "c", "generate", trajectory="t"), 5.0)
    assert third == [Release("r0", "a"), Replicate("r0", "c", True, False, 2 * G), Dispatch(22, "r0")]
    # With b's and c's turns running there, neither replica can go: a's next turn waits for room.
    s.handle(CallSubmitted(13, "b", "generate", trajectory="t"), 6.0)
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="t"), 6.0)) == []
    assert s.used_bytes("r0") == 4 * G
    after = s.handle(CallFinished(22), 7.0)  # c is idle now: its replica gives way to a's
    assert after == [Release("r0", "c"), Replicate("r0", "a", True, False, 2 * G), Dispatch(3, "r0")]


def test_a_turn_whose_replica_fits_no_rollout_worker_fails_with_what_to_change() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0"), 0.0)
    s.handle(WorkerJoined("r0", role="rollout", memory_bytes=1 * G), 0.0)
    s.handle(JobOpened("a", state_bytes=16 * G, pooled=True), 0.0)  # a 2 GB replica
    s.handle(CallSubmitted(1, "a", "open"), 0.0)
    s.handle(CallFinished(1), 0.0)
    (failed,) = s.handle(CallSubmitted(2, "a", "generate", trajectory="t"), 1.0)
    assert isinstance(failed, Fail) and failed.call_id == 2 and isinstance(failed.error, JobTooLargeError)
    assert "fits no rollout worker" in str(failed.error) and "pooled=True" in str(failed.error)
    assert s.queued("a") == 0


def test_a_lost_jobs_surviving_worker_is_released_when_the_job_is_forgotten() -> None:
    s = Scheduler()
    for e in [WorkerJoined("w0"), WorkerJoined("w1"), JobOpened("d", disaggregated=True)]:
        s.handle(e, 0.0)
    s.handle(CallSubmitted(1, "d", "open"), 0.0)
    follow = OwnCall("d", "open", follows=1)
    assert s.handle(CallFinished(1), 1.0) == [Dispatch(-1, "w1", own=follow)]  # its replica opens on w1
    assert s.handle(CallFinished(-1), 2.0) == []
    lost = s.handle(WorkerLost("w1", "test"), 3.0)
    assert [type(a) for a in lost] == [JobLost]
    assert s.handle(JobClosed("d"), 4.0) == [Release("w0", "d")]  # what its home still holds


def test_the_mlfq_moves_a_trajectory_down_by_service_and_by_what_its_tools_said() -> None:
    q = Mlfq(levels=4, service_s=(2.0, 8.0), turns_per_level=4, errors_per_level=1, budget_fraction=0.5)
    assert q.level(TurnSignals(), 0.0) == 0
    assert q.level(TurnSignals(), 2.0) == 1 and q.level(TurnSignals(), 8.0) == 2
    assert q.level(TurnSignals(tool_errors=1), 0.0) == 1 and q.level(TurnSignals(retries=2), 0.0) == 2
    assert q.level(TurnSignals(turn=3), 0.0) == 0 and q.level(TurnSignals(turn=4), 0.0) == 1
    assert q.level(TurnSignals(tokens=499, token_budget=1000), 0.0) == 0
    assert q.level(TurnSignals(tokens=500, token_budget=1000), 0.0) == 1
    assert q.level(TurnSignals(tool_errors=9), 99.0) == 3  # the last level holds the rest
    assert [bucket_for(level, [0, 2]) for level in range(4)] == [0, 0, 2, 2]
    assert bucket_for(0, [1, 3]) == 1  # below every bucket: the lowest


def test_the_mlfq_moves_a_trajectory_down_by_its_tokens_and_errors_against_its_peers_at_that_turn() -> None:
    q = Mlfq(peer_ratios=(2.0, 4.0), errors_per_level=1, budget_fraction=1.0)
    peers = Peers(seen=8, grown=100.0, errors=0.5)  # its job's trajectories at this turn
    turn = TurnSignals(turn=1, tokens=5000)
    assert [q.level(turn, 0.0, peers, grown) for grown in (50, 199, 200, 399, 400)] == [0, 0, 1, 1, 2]
    assert q.level(TurnSignals(turn=1, tool_errors=2), 0.0, peers, 100) == 1  # 1.5 errors beyond its peers'
    assert q.level(TurnSignals(turn=1, tool_errors=1), 0.0, peers, 100) == 0
    assert q.level(TurnSignals(turn=1, tool_errors=1), 0.0, None, 100) == 1  # no peers known: errors count whole
    assert q.level(TurnSignals(turn=0), 0.0, peers, 400) == 0  # a first turn has nothing to compare
    assert Mlfq(peer_ratios=()).level(TurnSignals(turn=1, tool_errors=2), 0.0, peers, 400) == 2  # no comparison


def test_a_trajectorys_peers_are_its_jobs_trajectories_at_the_same_turn_counted_from_their_prompts() -> None:
    t = Trajectories(Mlfq(peer_ratios=(2.0, 4.0), peer_min=4, budget_fraction=1.0))
    for i in range(4):  # 100-token prompts, 100 tokens more by turn 1
        assert t.turn("a", f"p{i}", TurnSignals(turn=0, tokens=100)) == 0
        assert t.turn("a", f"p{i}", TurnSignals(turn=1, tokens=200)) == 0
    # A 50-token prompt, 400 tokens more by turn 1: four times its peers' growth (two levels; its
    # whole 450 tokens over their 200 would be one).
    assert t.turn("a", "long", TurnSignals(turn=0, tokens=50)) == 0
    assert t.turn("a", "long", TurnSignals(turn=1, tokens=450)) == 2
    for i in range(3):  # job c: fewer than peer_min seen at turn 1, so nothing compares yet
        assert t.turn("c", f"q{i}", TurnSignals(turn=1, tokens=100 if i < 2 else 10_000)) == 0
    t.forget("a")  # a closed job's peers go with it
    assert t.turn("a", "fresh", TurnSignals(turn=1, tokens=10_000)) == 0


def test_pooled_turns_go_to_their_levels_bucket_least_loaded_first_and_back_to_their_last_worker() -> None:
    s = _pool(0, 0, 2, slots=8)
    assert _routing(s.handle(CallSubmitted(1, "a", "generate", trajectory="t"), 1.0)) == [Dispatch(1, "r0")]
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="u"), 1.0)) == [
        Dispatch(2, "r1")
    ]  # least loaded
    s.handle(CallFinished(1), 2.0)
    # t's next turn goes back to r0, its prefix cache (r0 runs no more than 4 turns above the least loaded).
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="t", signals=TurnSignals(turn=1)), 3.0)) == [
        Dispatch(3, "r0")
    ]
    s.handle(CallFinished(3), 4.0)
    # Two turns taken (level 1 of this queue): still bucket 0; the vLLM priority is the level.
    assert _routing(s.handle(CallSubmitted(4, "a", "generate", trajectory="t", signals=TurnSignals(turn=2)), 5.0)) == [
        Dispatch(4, "r0", priority=1)
    ]
    s.handle(CallFinished(4), 6.0)
    # A tool error: level 2, the stragglers' bucket.
    signals = TurnSignals(turn=3, tool_errors=1)
    assert _routing(s.handle(CallSubmitted(5, "a", "generate", trajectory="t", signals=signals), 7.0)) == [
        Dispatch(5, "r2", priority=2)
    ]


def test_a_full_bucket_lends_its_turns_to_the_buckets_below_never_above() -> None:
    s = _pool(0, 2, slots=1)  # r0: bucket 0, r1: bucket 2
    late = TurnSignals(tool_errors=2)
    assert _routing(s.handle(CallSubmitted(1, "a", "generate", trajectory="x", signals=late), 0.0)) == [
        Dispatch(1, "r1", priority=2)
    ]
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="y", signals=late), 0.0)) == [
        Dispatch(2, "r0", priority=2)  # bucket 2 is full: bucket 0 takes it
    ]
    assert (
        _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="z"), 0.0)) == []
    )  # level 0 waits for bucket 0
    assert _routing(s.handle(CallFinished(1), 1.0)) == []  # bucket 2's free slot is not for level 0
    assert _routing(s.handle(CallFinished(2), 2.0)) == [Dispatch(3, "r0")]


def test_a_trajectory_moves_down_once_its_turns_received_enough_service() -> None:
    s = _pool(0, 1)
    s.handle(CallSubmitted(1, "a", "generate", trajectory="t"), 0.0)
    s.handle(CallFinished(1), 12.0)  # 12 s of service: past the 10 s threshold
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="t", signals=TurnSignals(turn=1)), 13.0)) == [
        Dispatch(2, "r1", priority=1)
    ]
    # A level never goes back: the next turn with no new signal stays at level 1.
    s.handle(CallFinished(2), 14.0)
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="t"), 15.0)) == [
        Dispatch(3, "r1", priority=1)
    ]


def test_pooled_turns_wait_for_a_barrier_on_the_home_and_the_barrier_for_them() -> None:
    s = _pool(0)
    assert _routing(s.handle(CallSubmitted(1, "a", "generate", trajectory="t"), 0.0)) == [Dispatch(1, "r0")]
    assert _routing(s.handle(CallSubmitted(2, "a", "sync_weights"), 0.0)) == []  # waits for the turn on r0
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="u"), 0.0)) == []  # waits for the sync
    assert _routing(s.handle(CallFinished(1), 1.0)) == [Dispatch(2, "w0")]
    assert _routing(s.handle(CallFinished(2), 2.0)) == [Dispatch(3, "r0")]


def test_no_home_on_a_rollout_worker_and_turns_run_on_the_home_without_one() -> None:
    s = Scheduler("fifo")
    s.handle(WorkerJoined("r0", role="rollout"), 0.0)
    assert _routing(s.handle(JobOpened("a", pooled=True), 0.0)) == [Place("a", "")]  # it waits for a home
    s.handle(CallSubmitted(1, "a", "open"), 0.0)
    assert _routing(s.handle(WorkerJoined("w0"), 1.0)) == [Recover("a", "w0", restore=False), Dispatch(1, "w0")]
    s.handle(CallFinished(1), 2.0)
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="t"), 2.0)) == [Dispatch(2, "r0")]
    # The rollout worker is lost mid-turn: the turn is queued again and, with no rollout worker
    # left, runs on the job's home.
    assert _routing(s.handle(WorkerLost("r0", "test"), 3.0)) == [Dispatch(2, "w0")]


def test_a_worker_moved_to_training_finishes_its_turns_and_takes_no_more() -> None:
    s = _pool(0, 0, slots=1)
    assert _routing(s.handle(CallSubmitted(1, "a", "generate", trajectory="t"), 0.0)) == [Dispatch(1, "r0")]
    assert _routing(s.handle(WorkerRole("r0", "train"), 1.0)) == []  # its turn runs on
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="t2"), 1.0)) == [Dispatch(2, "r1")]
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="t3"), 1.0)) == []  # r1 full; r0 trains now
    assert _routing(s.handle(CallFinished(1), 2.0)) == []
    assert _routing(s.handle(JobOpened("b"), 2.0)) == [Place("b", "r0")]  # a home now (fewest jobs)
    assert _routing(s.handle(WorkerRole("r0", "rollout"), 3.0)) == [Dispatch(3, "r0")]  # and back: it takes turns again


def _routing(actions: list) -> list:
    """The actions but the replicas that go ahead of pooled turns (tested on their own above)."""
    return [a for a in actions if not isinstance(a, Replicate)]


def _moves_undrained(self: Pool) -> list:
    """Planted: every moving worker switches at once, whatever still runs there."""
    switching = [w for w in self.t.workers() if w.moving_to and not w.move_sent]
    for w in switching:
        w.move_sent = True
    return [MoveWorker(w.worker_id, w.moving_to) for w in switching if w.moving_to]


def _plant_no_buckets(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(Pool, "_takes_turn", lambda self, worker, buckets, job, call: True)


def _plant_spill_up(mp: pytest.MonkeyPatch) -> None:
    takes = Pool._takes_turn

    def spill_anywhere(self: Pool, worker: Any, buckets: dict[int, bool], job: Any, call: Any) -> bool:
        return takes(self, worker, buckets, job, call) or not buckets[bucket_for(call.level, list(buckets))]

    mp.setattr(Pool, "_takes_turn", spill_anywhere)


def _plant_levels_go_back(mp: pytest.MonkeyPatch) -> None:
    def turn(self: Trajectories, job_id: str, trajectory: str, signals: TurnSignals) -> int:
        traj = self._by_job.setdefault(job_id, {}).setdefault(trajectory, Trajectory())
        traj.level = self.mlfq.level(signals, traj.service_s)  # forgets the level it reached
        return traj.level

    mp.setattr(Trajectories, "turn", turn)


PLANTED = {
    "turns ignore buckets": _plant_no_buckets,
    "a full bucket's turns go to a higher one": _plant_spill_up,
    "levels go back up": _plant_levels_go_back,
    "turns stay on the home": lambda mp: mp.setattr(Tables, "pooled_away", lambda self, job: False),
    "homes on rollout workers": lambda mp: mp.setattr(Tables, "homes", lambda self: list(self.registered.values())),
    "training shares its worker with the turns left there": lambda mp: mp.setattr(
        Pool, "turns_left_on", lambda self, worker: False
    ),
    "a worker moving to training takes turns": lambda mp: mp.setattr(
        Tables, "takes_turns", staticmethod(lambda worker: worker.role == "rollout")
    ),
    "a worker switches to training with its turns running": lambda mp: mp.setattr(Pool, "moves_due", _moves_undrained),
    "a barrier's end wakes no rollout worker": lambda mp: mp.setattr(
        Calls,
        "other_workers",
        lambda self, call: [self.t.jobs[call.job_id].home] if call.job_id in self.t.jobs else [],
    ),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bugs_in_buckets_and_roles_are_caught_by_the_invariants(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    PLANTED[bug](monkeypatch)

    @settings(
        max_examples=3000,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        report_multiple_bugs=False,
    )
    @given(ops=st.lists(libra_op, min_size=30, max_size=80))
    # Tried first: a sequence a random search found to expose a moving worker taking turns (the
    # window in which a worker is seen moving is short).
    @example(ops=[("join", 1), ("join", 1), ("rollout", 2), *[("role", 0)] * 11, ("role", 23), ("open", 12),
                  ("open", 12), ("open", 0), ("turn", 814), ("join", 1), ("join", 1), ("join", 1), ("role", 0),
                  ("role", 0), ("role", 0), ("lose", 0), ("role", 16), ("tick", 1), ("rollout", 0),
                  ("rollout", 1)])  # fmt: skip
    def search(ops: list[tuple[str, int]]) -> None:
        check_invariants("plex", ops, rebalance=True)

    with pytest.raises(AssertionError):
        search()


def test_the_rebalancer_lends_an_idle_home_worker_to_rollout_and_takes_it_back_for_training() -> None:
    s = Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=2.0))
    s.handle(WorkerJoined("w0", slots=2, role="train"), 0.0)
    s.handle(WorkerJoined("r0", slots=1, role="rollout"), 0.0)
    s.handle(JobOpened("a", pooled=True), 0.0)
    # One step: a sync (its rollout starts when it ends, at 1 s), then training at 21 s: a 20 s phase.
    assert _routing(s.handle(CallSubmitted(1, "a", "sync_weights"), 0.0)) == [Dispatch(1, "w0")]
    s.handle(CallFinished(1), 1.0)
    assert _routing(s.handle(CallSubmitted(2, "a", "forward_backward"), 21.0)) == [Dispatch(2, "w0")]
    s.handle(CallFinished(2), 22.0)
    s.handle(CallSubmitted(3, "a", "sync_weights"), 22.0)
    s.handle(CallFinished(3), 23.0)  # the next rollout starts: ~20 s without training expected
    assert _routing(s.handle(CallSubmitted(4, "a", "generate", trajectory="t"), 23.0)) == [Dispatch(4, "r0")]
    assert _routing(s.handle(CallSubmitted(5, "a", "generate", trajectory="u"), 23.0)) == []  # r0 is full
    # 19 s of rollout left: a second rollout worker saves at most half of it, which beats a move
    # there and back (2 x 2 s): w0 goes to rollout, takes nothing meanwhile, and takes the waiting
    # turn once it has switched.
    assert _routing(s.handle(Tick(), 24.0)) == [MoveWorker("w0", "rollout")]
    assert _routing(s.handle(Tick(), 25.0)) == []
    assert _routing(s.handle(WorkerRole("w0", "rollout", seconds=3.0), 26.0)) == [Dispatch(5, "w0")]
    # Training is submitted (a 7 s phase: the mean is now 13.5 s): w0 goes back at once, and the
    # training runs there at once, exclusive: the turn still running there pauses until it ends,
    # and then w0 switches.
    assert _routing(s.handle(CallSubmitted(6, "a", "forward_backward"), 30.0)) == [Dispatch(6, "w0", exclusive=True)]
    s.handle(CallFinished(4), 31.0)
    assert _routing(s.handle(CallFinished(5), 31.0)) == [MoveWorker("w0", "train")]
    s.handle(WorkerRole("w0", "train", seconds=3.0), 31.0)
    s.handle(CallFinished(6), 33.0)
    s.handle(CallSubmitted(7, "a", "sync_weights"), 33.0)
    s.handle(CallFinished(7), 34.0)
    s.handle(CallSubmitted(8, "a", "generate", trajectory="v"), 34.0)
    s.handle(CallSubmitted(9, "a", "generate", trajectory="w"), 34.0)
    # Moves now measured at 3 s: half of 5.5 s of expected rollout left (13.5 - 8) does not pay for
    # one there and back (6 s), nor half of 11.5 s (2 s in); half of 13 s (0.5 s in) does.
    assert _routing(s.handle(Tick(), 42.0)) == []
    assert s.rebalancer is not None and s.rebalancer.expected_rollout_left_s("a", 36.0) == 11.5
    assert _routing(s.handle(Tick(), 36.0)) == []
    assert _routing(s.handle(Tick(), 34.5)) == [MoveWorker("w0", "rollout")]


def test_the_rebalancer_lends_a_home_by_its_jobs_rollout_time_so_far_and_not_for_a_job_between_phases() -> None:
    s = Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=1.0))
    s.handle(WorkerJoined("w0", slots=2, role="train"), 0.0)
    s.handle(WorkerJoined("r0", slots=1, role="rollout"), 0.0)
    for job, sync in (("a", 1), ("b", 2)):
        s.handle(JobOpened(job, pooled=True), 0.0)
        s.handle(CallSubmitted(sync, job, "sync_weights"), 0.0)
        s.handle(CallFinished(sync), 1.0)  # both start their first rollout at 1 s: no past phase to go by
    s.handle(CallSubmitted(3, "b", "forward_backward"), 2.0)
    s.handle(CallFinished(3), 3.0)  # b is between phases (it trains next): it does not hold w0 back
    assert _routing(s.handle(CallSubmitted(4, "a", "generate", trajectory="t"), 3.0)) == [Dispatch(4, "r0")]
    assert _routing(s.handle(CallSubmitted(5, "a", "generate", trajectory="u"), 3.0)) == []  # r0 is full
    # a's first phase, 2.5 s in, is expected to last 2.5 s more: half of that does not pay for a
    # move there and back (2 x 1 s); 5 s in, half of 5 s does.
    assert _routing(s.handle(Tick(), 3.5)) == []
    assert _routing(s.handle(Tick(), 6.0)) == [MoveWorker("w0", "rollout")]


def test_the_rebalancer_weighs_a_lent_home_by_its_devices_against_the_rollout_pools() -> None:
    """One device more saves 1/9 of the rollout left beside an 8-device tensor-parallel rollout
    worker, not the half it saves beside a one-device one: lent later, or not at all."""
    s = Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=1.0))
    s.handle(WorkerJoined("w0", slots=2, role="train"), 0.0)
    s.handle(WorkerJoined("r0", slots=1, role="rollout", devices=8), 0.0)
    s.handle(JobOpened("a", pooled=True), 0.0)
    s.handle(CallSubmitted(1, "a", "sync_weights"), 0.0)
    s.handle(CallFinished(1), 1.0)
    assert _routing(s.handle(CallSubmitted(2, "a", "generate", trajectory="t"), 1.0)) == [Dispatch(2, "r0")]
    assert _routing(s.handle(CallSubmitted(3, "a", "generate", trajectory="u"), 1.0)) == []  # r0 is full
    # 5 s in, the first phase is expected to last 5 s more: 1/9 of it does not pay for a move there
    # and back (2 x 1 s), as half of it would; 19.5 s in, 1/9 of 19.5 s does.
    assert _routing(s.handle(Tick(), 6.0)) == []
    assert _routing(s.handle(Tick(), 18.0)) == []
    assert _routing(s.handle(Tick(), 20.5)) == [MoveWorker("w0", "rollout")]
