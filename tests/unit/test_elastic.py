"""Elastic data parallelism (``coordinator/scheduler/elastic.py``): idle rollout workers join a
pooled job's training at an optimizer-step boundary and leave at a later one. A specification by
example, then invariants over random event sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.coordinator.events import (
    CallFinished,
    CallSubmitted,
    Dispatch,
    Fail,
    JobClosed,
    JobOpened,
    JobSized,
    OwnCall,
    Recover,
    Release,
    Replicate,
    Tick,
    WorkerJoined,
    WorkerLost,
)
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.scheduler import Scheduler

G = 10**9


def _trained_once(prior_move_s: float) -> Scheduler:
    """Pooled recoverable job "a" homed on train worker w0, rollout worker r0: opened (its first
    rollout from 1 s), one step trained from 11 s to 14 s (a 3 s training phase), then a rollout
    on r0 to 24 s; r0 idle since."""
    s = Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=prior_move_s))
    s.handle(WorkerJoined("w0", slots=2, role="train"), 0.0)
    s.handle(WorkerJoined("r0", slots=1, role="rollout"), 0.0)
    s.handle(JobOpened("a", pooled=True), 0.0)
    s.handle(JobSized("a", G, snapshots=True), 0.0)
    for call_id, kind, start, end in ((1, "open", 0.0, 1.0), (2, "forward_backward", 11.0, 12.0),
                                      (3, "optim_step", 12.0, 13.0), (4, "sync_weights", 13.0, 14.0),
                                      (5, "generate", 14.0, 24.0)):  # fmt: skip
        assert s.handle(CallSubmitted(call_id, "a", kind, trajectory="t" if kind == "generate" else ""), start)
        s.handle(CallFinished(call_id), end)
    return s


def test_an_idle_rollout_worker_joins_a_jobs_training_at_a_step_boundary_and_leaves_at_the_next() -> None:
    s = _trained_once(prior_move_s=0.5)
    # The next step's training: 3 s expected, half of it saved by a second member beats a join and
    # its way back (2 x 0.5 s). r0 joins behind a restore of the scheduler's own on both workers.
    join = OwnCall("a", "restore", join=True)
    assert s.handle(CallSubmitted(6, "a", "forward_backward"), 24.0) == [Dispatch(-1, "w0", own=join)]
    assert s.members(-1) == ("w0", "r0") and s.view("a").members == ("w0", "r0")
    assert s.used_bytes("r0") == G  # its replica's bytes gave way to the job's state
    assert s.handle(CallFinished(-1), 25.0) == [Dispatch(6, "w0")] and s.members(6) == ("w0", "r0")
    # The step's optim_step runs on both too (it all-reduces the gradients).
    assert s.handle(CallSubmitted(7, "a", "optim_step"), 25.5) == []
    s.handle(CallFinished(6), 26.0)
    assert s.members(7) == ("w0", "r0")
    # A sync submitted mid-step waits behind the optim_step; at the boundary r0 leaves first and
    # the sync runs on the home alone. r0 gets the job's replica back ahead of its next turn.
    assert s.handle(CallSubmitted(8, "a", "sync_weights"), 26.5) == []
    assert s.handle(CallFinished(7), 27.0) == [Release("r0", "a"), Dispatch(8, "w0")]
    assert s.members(8) == () and s.view("a").members == () and s.used_bytes("r0") == 0
    s.handle(CallFinished(8), 28.0)
    assert s.handle(CallSubmitted(9, "a", "generate", trajectory="u"), 28.0) == [
        Replicate("r0", "a", open=True, weights=True, weight_bytes=G // 8),
        Dispatch(9, "r0"),
    ]


def test_no_rollout_worker_joins_training_too_short_to_pay_for_the_join_or_while_it_runs_a_turn() -> None:
    s = _trained_once(prior_move_s=1.0)  # half of 3 s does not beat a join and its way back (2 x 1 s)
    assert s.handle(CallSubmitted(6, "a", "forward_backward"), 24.0) == [Dispatch(6, "w0")]
    assert s.members(6) == ()
    s = _trained_once(prior_move_s=0.5)
    s.handle(CallSubmitted(6, "a", "generate", trajectory="u"), 24.0)  # r0 is busy: it cannot join
    assert s.handle(CallSubmitted(7, "a", "forward_backward"), 24.0) == [Dispatch(7, "w0")]


def test_a_helper_lost_mid_step_rebuilds_the_job_from_its_snapshot_with_the_step_run_again() -> None:
    s = _trained_once(prior_move_s=0.5)
    s.handle(CallSubmitted(6, "a", "forward_backward"), 24.0)
    s.handle(CallFinished(-1), 25.0)
    s.handle(CallFinished(6), 26.0)  # its gradients are on both members: the step is open
    s.handle(CallSubmitted(7, "a", "optim_step"), 26.0)
    actions = s.handle(WorkerLost("r0", "killed"), 26.5)
    # A restore of its own (from the snapshot and the forward_backward since, which the server
    # replays) on the home, not a join; then the optim_step again, on the home alone.
    assert actions == [Recover("a", "w0"), Dispatch(-2, "w0", own=OwnCall("a", "restore"))], actions
    assert s.members(-2) == ()
    assert s.handle(CallFinished(-2), 27.0) == [Dispatch(7, "w0")] and s.members(7) == ()


# -- invariants over random sequences -----------------------------------------------------------

SCRIPT = ("generate", "generate", "forward_backward", "forward_backward", "optim_step", "sync_weights")
elastic_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 1)),  # job a's or b's client submits its next call
    st.tuples(st.just("submit"), st.integers(0, 1)),
    st.tuples(st.just("finish"), st.integers(0, 9)),  # the i-th running call ends well
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("fail"), st.integers(0, 9)),  # or with an error (the call's own: the job goes on)
    st.tuples(st.just("tick"), st.integers(1, 50)),  # tenths of a second pass
    st.tuples(st.just("lose"), st.integers(0, 2)),  # a rollout worker dies
    st.tuples(st.just("join"), st.integers(0, 0)),  # a new rollout worker registers
)


@settings(max_examples=800, deadline=None, derandomize=True)
@given(ops=st.lists(elastic_op, min_size=40, max_size=160))
def test_invariants_hold_as_rollout_workers_join_and_leave_training(ops: list[tuple[str, int]]) -> None:
    check_elastic(ops)


def test_the_invariant_model_sees_joins_and_a_helper_lost_mid_step() -> None:
    """The model above reaches what it checks: job a's client runs its script step after step,
    each call ending before the next is submitted; from the second step rollout workers join its
    training at each step, and then one dies while the step's forward_backward runs on it."""
    opens = [("finish", 0), ("finish", 0)]
    step = [("submit", 0), ("finish", 0)] * len(SCRIPT)
    assert check_elastic(opens + step * 4) == (3, 0)
    into_training = [("submit", 0), ("finish", 0)] * 4  # two turns, the join, the first forward_backward
    joins, lost = check_elastic(opens + step * 2 + into_training + [("lose", 0)] + step)
    assert joins >= 2 and lost == 1


def check_elastic(ops: list[tuple[str, int]]) -> tuple[int, int]:
    """Two pooled recoverable jobs homed on w0, each client cycling through ``SCRIPT`` (two turns,
    two forward_backwards, an optim_step, a sync) as ``ops`` submit, with rollout workers that come
    and go. Held to, at every action: a turn never runs on a worker helping a job train; a job's
    trainer calls run on its home and its helpers exactly while it is widened; a join, and a
    helper's leave, happen only at a step boundary with nothing of the job's trainer lane running;
    no call runs twice at once. At the end, with every call done and the jobs closed, nothing of
    them is left anywhere and every worker takes turns again. Returns the joins seen, and the
    helpers lost mid-step (the job's gradients on them, or its trainer call running there)."""
    s = Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=0.05))
    s.handle(WorkerJoined("w0", slots=2, role="train"), 0.0)
    rollout = ["r0", "r1"]
    for w in rollout:
        s.handle(WorkerJoined(w, slots=2, role="rollout"), 0.0)
    jobs = ["a", "b"]
    next_kind = {j: 0 for j in jobs}
    kind_of: dict[int, str] = {}
    job_of: dict[int, str] = {}
    running: dict[int, tuple[str, ...]] = {}  # call -> the workers it runs on
    unfinished: set[int] = set()
    step_open = {j: False for j in jobs}
    widened: dict[str, tuple[str, ...]] = {j: () for j in jobs}
    t, next_call, joins, added, lost_mid_step = 0.0, 1, 0, len(rollout) - 1, 0

    def check(actions: list) -> None:
        nonlocal joins
        for a in actions:
            if isinstance(a, Dispatch):
                job, kind = (a.own.job_id, a.own.kind) if a.own is not None else (job_of[a.call_id], kind_of[a.call_id])
                assert a.call_id not in running, "a call runs once at a time"
                members = s.members(a.call_id)
                if a.own is not None:
                    job_of[a.call_id], kind_of[a.call_id] = job, kind
                    unfinished.add(a.call_id)
                if a.own is not None and a.own.join:
                    assert not step_open[job] and not _trainer_running(job), "a join only at a step boundary"
                    assert len(members) >= 2 and members[0] == "w0"
                    widened[job] = members
                    joins += 1
                if kind == "generate":
                    assert not s.worker(a.worker_id).lent_to, "no turn on a worker helping a job train"
                    assert all(a.worker_id not in m[1:] for m in widened.values())
                    running[a.call_id] = (a.worker_id,)
                else:
                    assert a.worker_id == "w0" and members == widened[job], "trainer calls on the job's members"
                    running[a.call_id] = members or (a.worker_id,)
            elif isinstance(a, Release) and a.worker_id in widened[a.job_id][1:]:
                assert not step_open[a.job_id] and not _trainer_running(a.job_id), "a helper leaves at a boundary"
                widened[a.job_id] = tuple(w for w in widened[a.job_id] if w != a.worker_id)
                if len(widened[a.job_id]) == 1:
                    widened[a.job_id] = ()
            elif isinstance(a, Fail):
                unfinished.discard(a.call_id)
                running.pop(a.call_id, None)
            elif isinstance(a, Recover):
                widened[a.job_id] = ()  # rebuilt on its home from its snapshot

    def _trainer_running(job: str) -> bool:
        return any(job_of[c] == job and kind_of[c] != "generate" for c in running)

    def finish(c: int, error: str = "") -> None:
        nonlocal t
        t += 0.1  # each call takes a while: phases have lengths to go by
        job, kind = job_of[c], kind_of[c]
        del running[c]
        unfinished.discard(c)
        if not error and kind in ("forward_backward", "optim_step"):
            step_open[job] = kind == "forward_backward"
        check(s.handle(CallFinished(c, error=error), t))

    for j in jobs:
        check(s.handle(JobOpened(j, pooled=True), t))
        job_of[next_call], kind_of[next_call] = j, "open"
        unfinished.add(next_call)
        check(s.handle(CallSubmitted(next_call, j, "open"), t))
        next_call += 1
        check(s.handle(JobSized(j, G, snapshots=True), t))
    for op, arg in ops:
        if op == "submit":
            j = jobs[arg]
            kind = SCRIPT[next_kind[j] % len(SCRIPT)]
            next_kind[j] += 1
            c = next_call
            next_call += 1
            job_of[c], kind_of[c] = j, kind
            unfinished.add(c)
            trajectory = f"{j}{next_kind[j]}" if kind == "generate" else ""
            check(s.handle(CallSubmitted(c, j, kind, trajectory=trajectory), t))  # type: ignore[arg-type]
        elif op in ("finish", "fail") and running:
            c = sorted(running)[arg % len(running)]
            finish(c, "refused" if op == "fail" and kind_of[c] != "restore" else "")
        elif op == "tick":
            t += arg / 10
            check(s.handle(Tick(), t))
        elif op == "lose" and rollout:
            w = rollout.pop(arg % len(rollout))
            for j in jobs:
                if w in widened[j]:
                    lost_mid_step += step_open[j] or _trainer_running(j)
                    widened[j] = ()
            for c in [c for c, on in running.items() if w in on]:
                if kind_of[c] == "generate" or len(running[c]) > 1:
                    del running[c]  # requeued: it runs again
            check(s.handle(WorkerLost(w, "killed"), t))
        elif op == "join":
            added += 1
            w = f"r{added}"
            rollout.append(w)
            check(s.handle(WorkerJoined(w, slots=2, role="rollout"), t))
    for j in jobs:  # their clients close them
        c = next_call
        next_call += 1
        job_of[c], kind_of[c] = j, "close"
        unfinished.add(c)
        check(s.handle(CallSubmitted(c, j, "close"), t))
    for _ in range(1000):  # everything runs to its end
        if not running:
            t += 1.0
            check(s.handle(Tick(), t))
            if not running:
                break
        finish(min(running))
    assert not unfinished, f"calls never run: {sorted(unfinished)}"
    for j in jobs:
        check(s.handle(JobClosed(j), t))
    for w in s.workers():
        assert not w.lent_to and not w.jobs and w.used_bytes == 0, w
    return joins, lost_mid_step
