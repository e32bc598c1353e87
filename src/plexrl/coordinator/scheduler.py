"""The scheduler: a pure policy object. Events in, actions out; no I/O, no clock of its own.

The coordinator's server feeds it real events on real time; ``plexrl.sim`` feeds the same
object virtual events. Time (``now``) is an argument, ties are broken by submission order, so a
run replays exactly.

Invariants it keeps, whatever the policy:
- a job's calls run in two lanes: ``generate`` in its sampler lane, every other kind in its trainer
  lane, one call at a time and in submission order (generates may overlap, in priority order);
  a barrier (``open``, ``close``, ``sync_weights``, ``load``: they change what the sampler
  serves) waits for every earlier call of the job and holds back every later one;
- trainer-lane calls run on the job's home worker (affinity); the sampler lane runs there too,
  or, for a disaggregated job, on its sampler worker, or, for a pooled job, on the rollout
  workers: each turn in the bucket of its trajectory's level (``coordinator/buckets.py``), on
  the worker its trajectory's last turn ran on if that one has a free slot (its prefix cache);
  on the job's home while no rollout worker is registered. No job's home is a rollout worker;
- a worker runs at most ``slots`` calls at once, of them at most ``trainer_slots`` other than
  generates (a worker's trainer runs one call at a time, so the order of those is the policy's);
- a group job (``JobOpened.devices`` > 1) lives on an aligned block of workers of one node
  (``coordinator/groups.py``); its state, a shard on each member, moves on all members together
  and counts against each member's budget; its calls run one at a time on all members at once
  (gang): a call starts only when every member has drained, and nothing else starts on a member
  from the moment the group claims it until that call ends; losing a member ends or re-homes the
  job as a unit;
- every call, submitted or its own (``OwnCall``: negative ids), ends in exactly one ``Dispatch``
  followed by the server's ``CallFinished``, or in one ``Fail``; a recoverable job's calls running
  on a lost worker go back to the front of their queues (dispatched again on its new home, after
  a ``restore`` of its own).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from plexrl.coordinator import groups
from plexrl.coordinator import residency as rs
from plexrl.coordinator.accounting import Ledger
from plexrl.coordinator.buckets import Mlfq, Trajectories, bucket_for
from plexrl.coordinator.events import (
    Action,
    CallCancelled,
    CallFinished,
    CallSubmitted,
    Dispatch,
    EnginesMoved,
    Event,
    Fail,
    JobClosed,
    JobLost,
    JobOpened,
    JobResumed,
    JobSized,
    MoveEngines,
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
    WorkerJoined,
    WorkerLost,
    WorkerRole,
)
from plexrl.coordinator.policies import POLICIES, Policy
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.residency import Residency
from plexrl.errors import JobClosedError, JobTooLargeError, NoWorkersError, PlexError, WorkerLostError
from plexrl.names import CallKind, EngineState, Lane, Role, Tier
from plexrl.plan import (
    TRAINING_KINDS,
    JobShape,
    WorkerPlan,
    footprint,
    free_bytes,
    gib,
    held_bytes,
    must_sleep,
    refusal,
    served_bytes,
    sleep_level,
)

# -- state -------------------------------------------------------------------------------------

AWAKE: EngineState = "awake"  # a worker's vLLM engines
ASLEEP: EngineState = "asleep"
TO_SLEEP: EngineState = "to_sleep"
TO_WAKE: EngineState = "to_wake"


@dataclass(frozen=True, slots=True)
class _SwapInFlight:
    job_id: str
    to: Tier
    state_bytes: int


@dataclass(slots=True)
class _Worker:
    worker_id: str
    slots: int
    memory_bytes: float = math.inf
    bytes_per_s: float = 10e9
    used_bytes: int = 0  # state on the device or on its way there (or still leaving)
    swapping: _SwapInFlight | None = None  # the one transfer in flight on this worker
    running: set[int] = field(default_factory=set)
    trainer_slots: int = 1 << 30  # calls other than generate it runs at once
    training: set[int] = field(default_factory=set)  # the running ones of those
    jobs: set[str] = field(default_factory=set)  # jobs whose home it is
    samplers: set[str] = field(default_factory=set)  # disaggregated jobs whose generates run here
    role: Role = "both"  # "rollout": pooled jobs' turns, never a home; "train": homes only
    bucket: int = 0  # a rollout worker's bucket (the lowest trajectory level it serves)
    moving_to: Role | Literal[""] = ""  # the role a move takes it to (it takes no turns or new homes meanwhile)
    move_sent: bool = False  # that move's worker drained: MoveWorker is sent, WorkerRole not back yet
    node: str = ""  # its host: a group's members share one (groups.py)
    index: int = 0  # its device index on ``node``
    gang: str = ""  # the group job claiming it: its call runs here, or waits for this worker to drain
    stateless_generates: bool = False  # its sampler keeps its own copy of jobs' weights (vLLM): see needs_state
    background_calls: frozenset[str] = frozenset()  # kinds it runs beside its other calls, in no trainer slot
    devices: int = 1  # accelerators acting as one (a tensor-parallel sampler)
    plan: WorkerPlan | None = None  # its device and settings (None: only memory_bytes bounds jobs' state)
    # What its device holds beside jobs' movable state, by the plan, while a job of that base (or
    # that job) lives here: "weights:PATH" (a base model's frozen weights), "activations:PATH"
    # (the trainer's headroom for it), "engine:PATH" (the vLLM engine its LoRA jobs share) and
    # "engine:job:ID" (a full fine-tune job's own engine).
    fixed: dict[str, int] = field(default_factory=dict)
    engines: EngineState = AWAKE  # its vLLM engines: AWAKE, ASLEEP, or on their way (TO_SLEEP, TO_WAKE)
    engines_for: str = ""  # the job whose call their move in flight is for (charged its seconds)
    engines_level: int = 0  # the level they sleep at now (while ASLEEP or on their way)
    sleep_failed: bool = False  # a move of its engines failed: they stay awake from now on
    engines_since: float = 0.0  # when they reached the state they are in
    sleep_s: float = 0.0  # what their last sleep took (measured)
    wake_s: float = 0.0  # and their last wake
    wanted: EngineState | Literal[""] = ""  # the state a startable call needs them in, other than theirs ("": none)
    wanted_for: str = ""  # that call's job

    def takes_trainer_slot(self, call: _Call) -> bool:
        return call.lane == TRAINER and call.kind not in self.background_calls

    @property
    def switch_s(self) -> float:
        """What a round of its engines (a sleep and a wake) costs: how long they stay in a state
        before calls needing the other one stop the calls needing it (each switch then costs at
        most as much device time as it saves: ski rental)."""
        return self.sleep_s + self.wake_s

    def fixed_bytes(self, kind: str, fixed: dict[str, int] | None = None) -> int:
        """What ``fixed`` (its own by default) holds of ``kind`` ("weights", "activations", "engine")."""
        return sum(v for k, v in (self.fixed if fixed is None else fixed).items() if k.startswith(kind + ":"))

    def parts(self, fixed: dict[str, int] | None = None) -> tuple[int, int, int]:
        """What ``fixed`` (its own by default) holds: frozen weights, activation headroom, engines."""
        return (
            self.fixed_bytes("weights", fixed),
            self.fixed_bytes("activations", fixed),
            self.fixed_bytes("engine", fixed),
        )

    def held(self, fixed: dict[str, int] | None = None) -> int:
        """What its device holds beside jobs' state at its peak (``plan.held_bytes``)."""
        assert self.plan is not None
        return held_bytes(self.plan, *self.parts(fixed))

    def must_sleep(self) -> bool:
        """A training call here needs its engines asleep (``plan.must_sleep``)."""
        if self.plan is None or self.sleep_failed:
            return False
        return must_sleep(self.plan, self.used_bytes, *self.parts())

    @property
    def budget(self) -> float:
        """Device memory jobs' movable state may use now: the plan's room less what is fixed, at
        most ``memory_bytes``."""
        if self.plan is None:
            return self.memory_bytes
        return min(self.memory_bytes, free_bytes(self.plan) - self.held())


SAMPLER: Lane = "sampler"
TRAINER: Lane = "trainer"
BARRIERS: frozenset[CallKind] = frozenset({"open", "close", "sync_weights", "load", "restore", "set_weights"})
# A disaggregated job's barrier done on its home continues on its sampler worker (``_follow_on``):
# the replica opens there, takes the new (or loaded) weights, closes.
FOLLOW_ON: dict[CallKind, CallKind] = {
    "open": "open",
    "sync_weights": "set_weights",
    "load": "set_weights",
    "close": "close",
}
MAKES_STATE: frozenset[CallKind] = frozenset(
    {"open", "restore"}
)  # they create the job's state: they need room, not a transfer


def lane_of(kind: CallKind) -> Lane:
    return SAMPLER if kind == "generate" else TRAINER


@dataclass(slots=True)
class _ScheduledJob:
    job_id: str
    home: str
    state: Residency
    weight: float = 1.0
    base: str = ""
    sampler: str = ""  # the sampler lane's worker: home, or another worker when disaggregated
    queues: dict[Lane, list[int]] = field(default_factory=lambda: {SAMPLER: [], TRAINER: []})
    running: dict[Lane, set[int]] = field(default_factory=lambda: {SAMPLER: set(), TRAINER: set()})
    barriers: set[int] = field(default_factory=set)  # unfinished barrier calls
    unfinished: set[int] = field(default_factory=set)  # queued or running calls
    lost: PlexError | None = None  # why the job cannot go on (every call of it fails with this)
    closing: bool = False  # its close is submitted: its state is freed, never moved, from then on
    recoverable: bool = False  # rebuilt on another worker when its home is lost (colocated jobs only)
    rebuilding: bool = False  # re-homed, its restore not yet started: nothing else of it may start
    first_seq: int = 0  # the lowest order key given so far (front calls go below it)
    pooled: bool = False  # its generates run on the rollout workers (while any is registered)
    devices: int = 1  # a group job's size: ``state`` is then each member's shard
    members: tuple[str, ...] = ()  # a group job's workers, ``home`` first; () for a one-device job
    shape: JobShape | None = None  # what it trains, for the memory plan (None: unsized until it opens)
    opened: bool = False  # its open finished: some worker holds something of it
    weights_epoch: int = 0  # how often what it serves changed (sync_weights, load, restore done)

    def lanes_on(self, worker_id: str, pooled_away: bool = False) -> list[Lane]:
        """Its lanes that run on ``worker_id``; ``pooled_away``: its generates run on rollout workers."""
        if self.members:
            return [TRAINER, SAMPLER] if worker_id in self.members else []
        return [
            lane
            for lane in (TRAINER, SAMPLER)
            if (self.home if lane == TRAINER else self.sampler) == worker_id and not (lane == SAMPLER and pooled_away)
        ]

    def idle_on(self, worker_id: str, sampler_apart: bool = False) -> bool:
        """Nothing of it queued or running on ``worker_id`` (``sampler_apart``: nothing but generates,
        which need none of its state there)."""
        return not any(self.queues[lane] or self.running[lane] for lane in self.lanes_on(worker_id, sampler_apart))


@dataclass(frozen=True, slots=True)
class JobView:
    """What the coordinator's book and reports read of a job (the scheduler's own record is private)."""

    home: str  # its home worker ("": it waits for one)
    sampler: str  # a disaggregated job's sampler worker ("": its generates run at home, or pooled)
    pooled: bool  # its generates run on the rollout workers
    recoverable: bool  # rebuilt on another worker when its home is lost
    closing: bool  # its close is submitted
    lost: PlexError | None  # why it cannot go on (None: it can)


@dataclass(slots=True)
class _GroupSwap:
    """A group job's state moving on every member: done when the last member reports."""

    to: Tier
    pending: set[str]
    ok: bool = True


@dataclass(slots=True)
class _EngineGate:
    """One dispatch pass's view of a worker's engines: settled in a state, draining the calls that
    need it (a switch is due), and the state a call needs them in otherwise (its job: ``want_for``)."""

    settled: bool
    draining: bool
    want: EngineState | Literal[""]
    want_for: str


@dataclass(frozen=True, slots=True)
class _Call:
    call_id: int
    job_id: str
    kind: CallKind
    priority: int = 0
    seq: int = 0  # its place in its job's order: the call id, or below every other for a front call
    trajectory: str = ""  # a pooled job's turn: its trajectory
    level: int = 0  # and that trajectory's level when the turn was submitted
    lane: Lane = TRAINER  # generates: SAMPLER; so is a disaggregated job's follow-on (``_follow_on``)


STICKY_SLACK = 4  # a trajectory's turn goes back to its last worker unless that runs this many more turns than another

LOST = "its unsaved training state is gone: open the job again and load its last checkpoint"


class Scheduler:
    """``handle(event, now)`` returns the actions the server must carry out, in order."""

    def __init__(
        self,
        policy: str = "fifo",
        recovery_wait_s: float = 300.0,
        mlfq: Mlfq | None = None,
        rebalancer: Rebalancer | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy: Policy = POLICIES[policy]()
        self.recovery_wait_s = recovery_wait_s  # a job whose worker was lost waits this long for another
        self._workers: dict[str, _Worker] = {}
        self._jobs: dict[str, _ScheduledJob] = {}
        self._calls: dict[int, _Call] = {}
        self._ran_on: dict[int, str] = {}  # running call -> the worker it runs on (its slot)
        self._swapping: dict[str, str] = {}  # job -> worker, for state in transit
        self._waiting: set[str] = set()  # jobs with a ready call whose state is not on the device
        self._homeless: dict[str, tuple[float, str]] = {}  # job -> (since, why) while no worker can take it
        self._pooled: set[str] = set()  # pooled jobs
        self._rollout_ids: set[str] = set()  # workers taking pooled turns now (``_rollout``)
        self._moving_workers: set[str] = set()  # workers moving between roles (``_moves_due``)
        self._started: dict[int, float] = {}  # running turn of a pooled job -> when it started
        self._replicas: dict[str, dict[str, int]] = {}  # rollout worker -> pooled job -> weights epoch it serves
        self._own: dict[int, OwnCall] = {}  # unfinished calls of its own (``_queue_own``)
        self._own_ids = itertools.count(-1, -1)
        self._gangs: dict[int, tuple[str, tuple[str, ...]]] = {}  # running group call -> (job, members)
        self._group_swaps: dict[str, _GroupSwap] = {}  # group job -> its state's move in flight
        self.trajectories = Trajectories(mlfq or Mlfq())
        self.rebalancer = rebalancer  # moves home workers between training and rollout (None: roles stay)
        self.ledger = Ledger()

    # -- queries (for status and accounting) ----------------------------------------------------

    def queued(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        return sum(len(q) for q in job.queues.values()) if job else 0

    def is_running(self, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return bool(job and any(job.running.values()))

    def has_waiting(self) -> bool:
        """Some job waits for its state to be moved in, or for a worker, or the rebalancer has pooled
        jobs to watch (a ``Tick`` may now matter)."""
        return bool(
            self._waiting
            or self._homeless
            or (self.rebalancer is not None and self._pooled)
            or any(w.wanted for w in self._workers.values())
        )

    def queued_turns(self) -> int:
        """Pooled jobs' turns that could start now but wait for a rollout worker's slot."""
        return sum(len(self._startable(self._jobs[j], SAMPLER)) for j in self._pooled)

    def rollout_load(self) -> float:
        """Turns running per rollout worker, on average (0 with none)."""
        rollout = self._rollout()
        return sum(len(w.running) for w in rollout) / len(rollout) if rollout else 0.0

    def trainer_busy(self, job_id: str) -> bool:
        """The job has a trainer-lane call queued or running."""
        job = self._jobs.get(job_id)
        return bool(job and (job.queues[TRAINER] or job.running[TRAINER]))

    def workers(self) -> list[_Worker]:
        return list(self._workers.values())

    def job(self, job_id: str) -> _ScheduledJob:
        return self._jobs[job_id]

    def view(self, job_id: str) -> JobView:
        """The job as the scheduler holds it (KeyError: no such job)."""
        job = self._jobs[job_id]
        sampler = job.sampler if job.sampler != job.home else ""
        return JobView(job.home, sampler, job.pooled, job.recoverable, job.closing, job.lost)

    def where(self, call_id: int) -> str | None:
        """The worker running the call (None: queued, or not known)."""
        return self._ran_on.get(call_id)

    def busy_s(self, worker_id: str, now: float) -> float:
        return self.ledger.busy_s(worker_id, now)

    def residency(self, job_id: str) -> Residency | None:
        job = self._jobs.get(job_id)
        return job.state if job else None

    def running_on(self, worker_id: str) -> set[str]:
        """The kinds of the calls running on the worker (none for a worker it does not know)."""
        worker = self._workers.get(worker_id)
        return {self._calls[c].kind for c in worker.running if c in self._calls} if worker else set()

    def used_bytes(self, worker_id: str) -> int:
        return self._workers[worker_id].used_bytes

    def budget(self, worker_id: str) -> float:
        """The device memory jobs' state may use on the worker now (the plan's room, at most its budget)."""
        return self._workers[worker_id].budget

    def bytes_per_s(self, worker_id: str) -> float:
        """The worker's host<->device bandwidth as measured so far (the transfer cost model)."""
        return self._workers[worker_id].bytes_per_s

    # -- events ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        """The actions ``event`` calls for: its own step's, then whatever the workers it touched
        can start now (dispatch looks only there)."""
        match event:  # the frequent events first
            case CallSubmitted():
                actions, touched = self._on_call_submitted(event, now)
            case CallFinished():
                actions, touched = self._on_call_finished(event, now)
            case WorkerJoined():
                actions, touched = self._on_worker_joined(event, now)
            case WorkerRole():
                actions, touched = self._on_worker_role(event, now)
            case WorkerLost(worker_id, reason):
                actions, touched = self._lose_worker(worker_id, reason, now), []
            case JobOpened():
                actions, touched = self._on_job_opened(event, now), []
            case JobResumed():
                actions, touched = self._on_job_resumed(event, now), []
            case JobSized(job_id, state_bytes, snapshots):
                if (sized := self._jobs.get(job_id)) is not None:
                    sized.recoverable = snapshots and sized.sampler == sized.home  # colocated jobs only
                actions, touched = [], [w for w in [self._resize(job_id, state_bytes)] if w]
            case JobClosed():
                actions, touched = self._on_job_closed(event, now)
            case SwapDone(job_id, seconds, moved_bytes, ok, worker_id) if job_id in self._group_swaps:
                actions, touched = [], self._group_swap_done(job_id, worker_id, seconds, moved_bytes, ok)
            case SwapDone(job_id, seconds, moved_bytes, ok):
                actions, touched = [], [w for w in [self._swap_done(job_id, seconds, moved_bytes, ok)] if w]
            case ReplicaFailed(worker_id, job_id):
                actions, touched = self._replica_failed(worker_id, job_id), []
            case EnginesMoved(worker_id, seconds, ok):
                actions, touched = [], [w for w in [self._engines_moved(worker_id, seconds, ok, now)] if w]
            case Tick():
                actions, touched = self._on_tick(now), []
            case CallCancelled():
                actions, touched = [], self._on_call_cancelled(event)
        for worker_id in touched:
            if worker_id in self._workers:
                actions += self._dispatch(self._workers[worker_id], now)
        if self._moving_workers:
            actions += self._moves_due()
        return actions

    def _on_call_submitted(self, event: CallSubmitted, now: float) -> tuple[list[Action], list[str]]:
        job_id, kind, trajectory = event.job_id, event.kind, event.trajectory
        level = self.trajectories.turn(job_id, trajectory, event.signals) if trajectory and kind == "generate" else 0
        call = self._new_call(event.call_id, job_id, kind, event.priority, event.front, trajectory, level)
        return self._submit(call, now), self._lane_workers(call)

    def _on_call_finished(self, event: CallFinished, now: float) -> tuple[list[Action], list[str]]:
        call_id, error = event.call_id, event.error
        actions: list[Action] = []
        done = self._calls.get(call_id)
        ran = self._ran_on.get(call_id)
        touched = [ran] if ran else self._lane_workers(done) if done is not None else []
        touched = list(self._gangs[call_id][1]) if call_id in self._gangs else touched
        started = self._started.pop(call_id, None)
        if done is not None and done.trajectory and ran and started is not None:
            self.trajectories.ran(done.job_id, done.trajectory, ran, now - started)
        follows = not error and self.follows_on(call_id)
        self._finish(call_id, now)
        if done is not None and follows:
            self._follow_on(done, now)
        if done is None:
            return actions, touched
        job = self._jobs.get(done.job_id)
        if job is not None and not error:
            job.opened |= done.kind in MAKES_STATE
            job.weights_epoch += done.kind in ("sync_weights", "load", "restore")
        rollout_starts = done.kind in ("open", "restore", "sync_weights") and not error
        if job is not None and job.pooled and self.rebalancer is not None and rollout_starts:
            self.rebalancer.rollout_started(job.job_id, now)
        if job is not None and error and done.kind in MAKES_STATE:
            if done.kind == "open":  # nothing of the job exists: its other calls fail
                actions += self._lose_job(job, JobClosedError(f"job {job.job_id} did not open: {error}"), now)
            else:
                reason = f"job {job.job_id} could not be restored on another worker ({error}); " + LOST
                actions += self._lose_job(job, WorkerLostError(reason), now)
        # A barrier's end (or any call's, before a barrier) may free the other lane too.
        for other in self._other_workers(done):
            if other not in touched and other in self._workers:
                actions += self._dispatch(self._workers[other], now)
        return actions, touched

    def _on_worker_joined(self, joined: WorkerJoined, now: float) -> tuple[list[Action], list[str]]:
        worker = _Worker(joined.worker_id, max(1, joined.slots), joined.memory_bytes, joined.swap_bytes_per_s,
                         role=joined.role, bucket=joined.bucket, node=joined.node, index=joined.index,
                         stateless_generates=joined.stateless_generates, devices=max(1, joined.devices),
                         plan=joined.plan, background_calls=frozenset(joined.background_calls))  # fmt: skip
        worker.trainer_slots = joined.trainer_slots if joined.trainer_slots > 0 else worker.slots
        self._workers[worker.worker_id] = worker
        self._roles_changed(worker)
        # The first rollout worker (or a new bucket) takes turns queued on homes (or elsewhere).
        touched = sorted(self._workers) if worker.role == "rollout" else [worker.worker_id]
        return self._rehome_waiting(now), touched

    def _on_worker_role(self, event: WorkerRole, now: float) -> tuple[list[Action], list[str]]:
        moved = self._workers.get(event.worker_id)
        if moved is None:
            return [], []
        if event.seconds > 0 and self.rebalancer is not None:
            self.rebalancer.moved(event.seconds)
        if event.role == moved.role and not moved.moving_to:
            return [], []
        moved.role, moved.moving_to, moved.move_sent = event.role, "", False  # the move is over (or overridden)
        self._moving_workers.discard(moved.worker_id)
        self._roles_changed(moved)  # its running calls finish where they are
        actions = self._rehome_waiting(now) if event.role != "rollout" else []
        return actions, sorted(self._workers)  # queued turns re-route

    def _on_job_opened(self, event: JobOpened, now: float) -> list[Action]:
        job_id, pooled = event.job_id, event.pooled
        if event.devices != 1:
            return self._place_group(
                job_id, event.state_bytes, event.weight, event.base, event.devices, event.disaggregated or pooled, now
            )
        actions = self._place(
            job_id, event.state_bytes, event.weight, event.base, event.disaggregated, now, event.shape
        )
        if pooled and job_id in self._jobs:
            self._jobs[job_id].pooled = True
            self._pooled.add(job_id)
        return actions

    def _on_job_resumed(self, event: JobResumed, now: float) -> list[Action]:
        job_id = event.job_id
        job = _ScheduledJob(job_id, "", Residency(event.state_bytes, rs.HOST), weight=event.weight, base=event.base)
        job.recoverable = job.rebuilding = True
        self._jobs[job_id] = job
        self.ledger.job_opened(job_id, now)
        self._homeless[job_id] = (now, f"job {job_id} was resumed from the journal of a restarted coordinator")
        actions = self._rehome(job, now)
        if not actions:
            return [Recover(job_id, "", restore=False)]
        return actions + self._dispatch(self._workers[job.home], now)  # its restore starts

    def _on_job_closed(self, event: JobClosed, now: float) -> tuple[list[Action], list[str]]:
        job_id = event.job_id
        actions: list[Action] = []
        touched: list[str] = []
        job = self._jobs.get(job_id)
        if job is not None and job.unfinished:  # nothing is left to run them on
            actions += self._lose_job(job, JobClosedError(f"job {job_id} was closed before the call ran"), now)
        self._homeless.pop(job_id, None)
        self._pooled.discard(job_id)
        self.trajectories.forget(job_id)
        if self.rebalancer is not None:
            self.rebalancer.forget(job_id)
        self.ledger.job_closed(job_id, now)
        self._waiting.discard(job_id)
        actions += self._releases(job)
        job = self._jobs.pop(job_id, None)
        if job and job.members:
            touched = self._disband(job, now)
            job = None
        if job and job.sampler in self._workers:
            self._workers[job.sampler].samplers.discard(job_id)
        if job and job.home in self._workers:
            worker = self._workers[job.home]
            self._unhome(worker, job)
            if job.state.tier == rs.DEVICE:  # state in transit is settled by its SwapDone
                worker.used_bytes -= job.state.state_bytes
            touched = [job.home]
        if self._homeless:  # a worker it held may take a waiting job now (dedicated)
            actions += self._rehome_waiting(now)
        return actions, touched

    def _releases(self, job: _ScheduledJob | None) -> list[Release]:
        """What workers hold of a job being forgotten: its replicas on rollout workers, and if it was
        lost after it opened, what its surviving workers hold (a closed job's close freed that)."""
        if job is None:
            return []
        held = sorted(w for w, replicas in self._replicas.items() if replicas.pop(job.job_id, None) is not None)
        if job.lost is not None and job.opened:
            held += sorted({job.home, job.sampler} & self._workers.keys())
        return [Release(w, job.job_id) for w in held]

    def _replicate(self, worker: _Worker, job: _ScheduledJob, call: _Call) -> list[Action]:
        """What ``worker`` needs before it runs a pooled job's turn: a replica of the job's sampler,
        and its current weights (``Replicate``), unless it has them."""
        if not job.pooled or call.lane != SAMPLER or worker.worker_id == job.home:
            return []
        held = self._replicas.setdefault(worker.worker_id, {})
        new = job.job_id not in held
        stale = held.get(job.job_id, 0) != job.weights_epoch
        if not new and not stale:
            return []
        held[job.job_id] = job.weights_epoch
        return [
            Replicate(
                worker.worker_id, job.job_id, open=new, weights=stale, weight_bytes=self._weight_bytes(worker, job)
            )
        ]

    @staticmethod
    def _weight_bytes(worker: _Worker, job: _ScheduledJob) -> int:
        """What the job's served weights weigh on ``worker``: its trained parameters in the device's
        dtype (by the plan; else estimated from its state, as an AdamW job's in bf16)."""
        if worker.plan is not None and job.shape is not None:
            return job.shape.trained_params * worker.plan.dtype_bytes
        return served_bytes(job.state.state_bytes)

    def _replica_failed(self, worker_id: str, job_id: str) -> list[Action]:
        """The worker gets the replica again before the job's next turn there; what it holds goes."""
        if self._replicas.get(worker_id, {}).pop(job_id, None) is None or job_id not in self._jobs:
            return []
        return [Release(worker_id, job_id)]

    def _on_tick(self, now: float) -> list[Action]:
        """Waiting jobs may hit their starvation bound (or homeless ones their recovery wait), an
        engines' switch may be due, and the rebalancer may move a worker."""
        actions: list[Action] = []
        for job_id, (since, why) in sorted(self._homeless.items()):
            if now - since >= self.recovery_wait_s:
                del self._homeless[job_id]
                job = self._jobs[job_id]
                opening = any(self._calls[c].kind == "open" for c in job.unfinished)
                gave_up = (NoWorkersError if opening else WorkerLostError)(
                    f"{why}, and no worker could take it over within {self.recovery_wait_s:g} s"
                )
                actions += self._lose_job(job, gave_up, now)
        homes = {self._jobs[j].home for j in self._waiting if j in self._jobs}
        homes |= {w.worker_id for w in self._workers.values() if w.wanted}
        for worker_id in sorted(homes & self._workers.keys()):
            actions += self._dispatch(self._workers[worker_id], now)
        if self.rebalancer is not None and self._pooled:
            for worker_id, role in self.rebalancer.plan(self, now):
                actions += self._move_worker(self._workers[worker_id], role, now)
        return actions

    def _on_call_cancelled(self, event: CallCancelled) -> list[str]:
        cancelled = self._calls.get(event.call_id)
        self._cancel(event.call_id)
        group = self._jobs.get(cancelled.job_id) if cancelled is not None else None
        if group is not None and group.members:  # its claim on the members may have no call left
            return self._unclaim(group)
        return []

    def _place(
        self,
        job_id: str,
        state_bytes: int,
        weight: float,
        base: str,
        disaggregated: bool,
        now: float,
        shape: JobShape | None = None,
    ) -> list[Action]:
        if not self._homes() and not disaggregated:
            # None registered yet (the coordinator just started, or restarted and its workers are
            # registering again; or only rollout workers): it waits for one like a job whose worker was lost.
            job = _ScheduledJob(job_id, "", Residency(state_bytes, rs.HOST), weight=weight if weight > 0 else 1.0,
                                base=base, shape=shape)  # fmt: skip
            self._jobs[job_id] = job
            self.ledger.job_opened(job_id, now)
            why = f"job {job_id} opened with no worker registered (start one with `plexrl worker --coordinator ADDR`)"
            self._homeless[job_id] = (now, why)
            return [Place(job_id, "")]
        job = _ScheduledJob(job_id, "", Residency(state_bytes, rs.HOST), weight=weight if weight > 0 else 1.0,
                            base=base, shape=shape)  # fmt: skip
        chosen = self._choose(job, disaggregated, now)
        if isinstance(chosen, NoWorkersError):
            return [Fail(job_id, None, chosen)]
        worker = chosen
        self._home(worker, job)
        # A new job's state starts on the device if it fits there, else in host memory.
        fits = worker.used_bytes + job.state.state_bytes <= worker.budget
        job.state.tier = rs.DEVICE if fits else rs.HOST
        sampler = worker
        if disaggregated:
            chosen_sampler = self.policy.sampler([w for w in self._homes() if w is not worker])
            assert chosen_sampler is not None, "place() leaves a second worker for a disaggregated job"
            sampler = chosen_sampler
            sampler.samplers.add(job_id)
        job.sampler = sampler.worker_id
        self._jobs[job_id] = job
        if fits:
            worker.used_bytes += job.state.state_bytes
        self.ledger.job_opened(job_id, now)
        return [Place(job_id, worker.worker_id, sampler.worker_id if disaggregated else "")]

    def _choose(self, job: _ScheduledJob, disaggregated: bool, now: float) -> _Worker | NoWorkersError:
        """The home worker for a job (new, or one whose home was lost), or why there is none."""
        homes = self._homes()
        if not homes:
            return NoWorkersError(
                "no worker that takes jobs' homes is registered (rollout workers take none): start one with "
                "`plexrl worker --coordinator ADDR`"
            )
        if disaggregated and len(homes) < 2:
            return NoWorkersError(
                "a disaggregated job needs two workers (trainer and sampler): start another worker, "
                "or open the job colocated"
            )
        fitting = [w for w in homes if self._room_alone(w, job) >= self._state_bytes(w, job)]
        if not fitting:
            return self._too_large(job, homes)
        return self.policy.place(self, fitting, job.state.state_bytes, job.base, disaggregated, now)

    def _state_bytes(self, worker: _Worker, job: _ScheduledJob) -> int:
        """The job's movable state on ``worker``: the plan's, or as sized so far."""
        if worker.plan is None or job.shape is None:
            return job.state.state_bytes
        return footprint(worker.plan, job.shape).state

    def _adds(self, worker: _Worker, job: _ScheduledJob) -> dict[str, int]:
        """What homing ``job`` on ``worker`` fixes on its device beyond its movable state (the plan's)."""
        if worker.plan is None or job.shape is None:
            return {}
        fp = footprint(worker.plan, job.shape)
        adds = {f"engine:job:{job.job_id}": fp.pinned} if fp.pinned else {}
        if f"weights:{job.base}" not in worker.fixed:
            adds[f"weights:{job.base}"] = fp.parts["base weights"]
            adds[f"activations:{job.base}"] = fp.parts["activations"]
            if fp.parts["shared engine"]:
                adds[f"engine:{job.base}"] = fp.parts["shared engine"]
        return adds

    def _room_alone(self, worker: _Worker, job: _ScheduledJob) -> float:
        """The room ``job``'s movable state would have on ``worker`` with every other job's moved out."""
        if worker.plan is None:
            return worker.memory_bytes
        return min(worker.memory_bytes, free_bytes(worker.plan) - worker.held(worker.fixed | self._adds(worker, job)))

    def _home(self, worker: _Worker, job: _ScheduledJob) -> None:
        """Make ``worker`` the job's home: what it fixes there is counted, its state sized by the plan."""
        worker.jobs.add(job.job_id)
        job.home = worker.worker_id
        worker.fixed.update(self._adds(worker, job))
        if worker.plan is not None and job.shape is not None:
            job.state.state_bytes = footprint(worker.plan, job.shape).state

    def _unhome(self, worker: _Worker, job: _ScheduledJob) -> None:
        """The job leaves ``worker``: what it fixed there is released (its base with its last job)."""
        worker.jobs.discard(job.job_id)
        worker.fixed.pop(f"engine:job:{job.job_id}", None)
        if not any(self._jobs[j].base == job.base for j in worker.jobs if j in self._jobs):
            for kind in ("weights", "activations", "engine"):
                worker.fixed.pop(f"{kind}:{job.base}", None)

    def _too_large(self, job: _ScheduledJob, homes: list[_Worker]) -> NoWorkersError:
        """Why no worker can hold ``job``, with the plan's numbers."""
        planned = [w for w in homes if w.plan is not None]
        if job.shape is None or not planned:
            most = max(w.budget for w in homes)
            size = job.state.state_bytes
            return NoWorkersError(f"job state of {size} bytes fits no worker (largest budget {most:.0f} bytes)")
        best = max(planned, key=lambda w: self._room_alone(w, job))
        assert best.plan is not None
        why = refusal(best.plan, job.shape, footprint(best.plan, job.shape))
        if why is None:  # it fits an empty worker: what else holds the best one's device
            others = ", ".join(f"{k} {gib(v)}" for k, v in best.fixed.items())
            why = (
                f"it needs {gib(self._state_bytes(best, job))} for its state beside {others or 'nothing'}, "
                f"and the budget is {gib(best.memory_bytes)}"
            )
        return JobTooLargeError(
            f"job {job.job_id} fits no worker: on {best.worker_id} ({best.plan.device_type}, "
            f"{gib(best.plan.capacity_bytes)}, {best.plan.dtype}) {why}. Use a smaller model or LoRA rank, "
            "a smaller --max-tokens-per-microbatch, or a worker with more memory"
        )

    def _resize(self, job_id: str, state_bytes: int) -> str | None:
        job = self._jobs.get(job_id)
        if job is None or job.state.tier not in (rs.DEVICE, rs.HOST):
            return None  # sizes arrive with the opening call, which runs on the device: not in transit
        if job.state.tier == rs.DEVICE:
            for member in job.members or (job.home,):
                self._workers[member].used_bytes += state_bytes - job.state.state_bytes
        job.state.state_bytes = state_bytes
        return job.home

    def _homes(self) -> list[_Worker]:
        """The workers a job's home may be on."""
        return [w for w in self._workers.values() if w.role != "rollout" and w.moving_to != "rollout"]

    def _rollout(self) -> list[_Worker]:
        """The workers taking pooled turns (not one a MoveWorker is taking elsewhere)."""
        return [self._workers[w] for w in sorted(self._rollout_ids)]

    def _roles_changed(self, worker: _Worker) -> None:
        """Keep ``_rollout_ids`` (every dispatch asks it: a scan of all workers would cost the
        simulator half its speed on 1024 devices) up to date with ``worker``'s role."""
        if self._takes_turns(worker) and worker.worker_id in self._workers:
            self._rollout_ids.add(worker.worker_id)
        else:
            self._rollout_ids.discard(worker.worker_id)

    @staticmethod
    def _takes_turns(worker: _Worker) -> bool:
        """The worker takes pooled jobs' turns: a rollout worker no move is taking elsewhere."""
        return worker.role == "rollout" and not worker.moving_to

    def _pooled_away(self, job: _ScheduledJob) -> bool:
        """The job's generates run on the rollout workers (it is pooled and one is registered)."""
        return job.pooled and bool(self._rollout_ids)

    def needs_state(self, job: _ScheduledJob, lane: Lane, worker: _Worker) -> bool:
        """Whether ``job``'s ``lane`` running on ``worker`` needs the job's state on that device.
        Every lane on its home does, except generates there when the worker's sampler serves them
        from a copy of the weights of its own (vLLM's adapters: only training waits for a move in)
        or when they are a pooled job's turns and rollout workers take those."""
        if worker.worker_id != job.home:
            return False
        return lane == TRAINER or not (worker.stateless_generates or self._pooled_away(job))

    def waits_for_move(self, job: _ScheduledJob, call: _Call, worker: _Worker) -> bool:
        """``call`` cannot start on ``worker`` until the job's state is on that device (a close frees
        the state wherever it is)."""
        tier = job.state.tier
        if tier == rs.DEVICE or not self.needs_state(job, call.lane, worker):
            return False
        return not (tier == rs.HOST and call.kind == "close")

    def _state_lanes(self, job: _ScheduledJob) -> tuple[Lane, ...]:
        """The lanes whose calls count in the job's idle gaps (residency's break-even rule): both,
        but the generates of a one-device job whose home's sampler needs none of its state."""
        home = self._workers.get(job.home)
        if home is not None and home.stateless_generates and not job.members and job.sampler == job.home:
            return (TRAINER,)
        return (TRAINER, SAMPLER)

    def _move_worker(self, worker: _Worker, role: Role, now: float) -> list[Action]:
        """Start moving ``worker`` to ``role``: from now on it takes no turns (and, bound for
        rollout, no new homes); turns that waited for it go to the other rollout workers. It
        switches once drained (``_moves_due``)."""
        worker.moving_to = role
        self._moving_workers.add(worker.worker_id)
        self._roles_changed(worker)
        actions: list[Action] = []
        for other in sorted(w.worker_id for w in self._rollout()):
            actions += self._dispatch(self._workers[other], now)
        return actions

    def _moves_due(self) -> list[Action]:
        """``MoveWorker`` for each moving worker that has drained: one bound for rollout at once (its
        homes' trainer calls run on there), one bound for training once no turn runs on it."""
        actions: list[Action] = []
        for worker_id in sorted(self._moving_workers):
            worker = self._workers.get(worker_id)
            if worker is None or worker.move_sent:
                continue
            turns = any(self._calls[c].kind == "generate" for c in worker.running if c in self._calls)
            if worker.moving_to == "rollout" or not turns:
                worker.move_sent = True
                actions.append(MoveWorker(worker_id, worker.moving_to or worker.role))
        return actions

    def _takes_turn(self, worker: _Worker, buckets: dict[int, bool], job: _ScheduledJob, call: _Call) -> bool:
        """The rollout ``worker`` may start this turn of a pooled job: it is in the bucket serving the
        turn's level, or in a lower one while every worker of that bucket is full (``buckets``: each
        bucket, whether one of its workers has a free slot); and the turn's trajectory's last
        worker, if another, does not take it back (``_sticks``)."""
        preferred = bucket_for(call.level, list(buckets))
        if worker.bucket > preferred or (worker.bucket < preferred and buckets[preferred]):
            return False
        traj = self.trajectories.get(job.job_id, call.trajectory) if call.trajectory else None
        if traj is None or traj.worker in ("", worker.worker_id):
            return True
        return not self._sticks(self._workers.get(traj.worker), worker.bucket, len(worker.running))

    @staticmethod
    def _sticks(last: _Worker | None, bucket: int, least: int) -> bool:
        """A trajectory's next turn goes back to ``last`` (its prefix cache is there): a rollout worker
        of ``bucket`` with a free slot, running at most ``STICKY_SLACK`` turns more than ``least``."""
        return (
            last is not None
            and last.role == "rollout"
            and not last.moving_to
            and last.bucket == bucket
            and len(last.running) < last.slots
            and len(last.running) <= least + STICKY_SLACK
        )

    def _new_call(
        self,
        call_id: int,
        job_id: str,
        kind: CallKind,
        priority: int,
        front: bool,
        trajectory: str = "",
        level: int = 0,
    ) -> _Call:
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"call {call_id} for unplaced job {job_id}")
        seq = call_id
        if front:
            job.first_seq -= 1
            seq = job.first_seq
        return _Call(call_id, job_id, kind, priority, seq, trajectory, level, lane_of(kind))

    def _submit(self, call: _Call, now: float) -> list[Action]:
        job = self._jobs.get(call.job_id)
        if job is None:
            raise KeyError(f"call {call.call_id} for unplaced job {call.job_id}")
        if job.lost is not None:
            return [Fail(call.job_id, call.call_id, job.lost)]
        self._calls[call.call_id] = call
        lanes = self._state_lanes(job)
        idle = not any(job.queues[lane] or job.running[lane] for lane in lanes)
        if call.lane in lanes and idle and job.state.last_done_s is not None:
            job.state.observe_gap(now - job.state.last_done_s)  # it was idle since its last call
        self._enqueue(job, call)
        job.unfinished.add(call.call_id)
        if call.kind in BARRIERS:
            job.barriers.add(call.call_id)
        job.closing |= call.kind == "close"
        if self.rebalancer is not None and job.pooled and call.lane == TRAINER:
            if call.kind == "forward_backward":
                self.rebalancer.training_started(job.job_id, now)
            home = self._workers.get(job.home)
            if home is not None and home.role == "rollout" and not home.moving_to:  # training is on the critical path
                return self._move_worker(home, "train", now)
        return []

    def _lane_workers(self, call: _Call) -> list[str]:
        """Where the call's lane runs: its home or sampler worker, or for a pooled job's turn the
        rollout workers of its bucket (its trajectory's last one first), then of the buckets below."""
        job = self._jobs.get(call.job_id)
        if job is None:
            return []
        if call.lane == SAMPLER and self._pooled_away(job):
            buckets = sorted({w.bucket for w in self._rollout()})
            bucket = bucket_for(call.level, buckets)
            traj = self.trajectories.get(job.job_id, call.trajectory) if call.trajectory else None
            last = traj.worker if traj is not None else ""
            # The least loaded first (each running turn slows a worker's decode steps), its last
            # worker ahead of them if it sticks; then the buckets below, for when this one is full.
            same = sorted(
                (w for w in self._rollout() if w.bucket == bucket), key=lambda w: (len(w.running), w.worker_id)
            )
            below = sorted((w for w in self._rollout() if w.bucket < bucket), key=lambda w: (-w.bucket, len(w.running)))
            ids = [w.worker_id for w in same]
            least = len(same[0].running) if same else 0
            if last in ids and self._sticks(self._workers[last], bucket, least):
                ids.remove(last)
                ids.insert(0, last)
            return ids + [w.worker_id for w in below]
        return [job.sampler if call.lane == SAMPLER else job.home]

    def _other_workers(self, call: _Call) -> list[str]:
        """Where the job's other lane runs: the call's end may let a call start there (a barrier)."""
        job = self._jobs.get(call.job_id)
        if job is None:
            return []
        if call.lane == SAMPLER:
            return [job.home]
        if self._pooled_away(job):
            return sorted(w.worker_id for w in self._rollout())
        return [job.sampler]

    def _finish(self, call_id: int, now: float) -> None:
        call = self._calls.pop(call_id, None)
        self._own.pop(call_id, None)
        self._release_gang(call_id, now)
        worker = self._workers.get(self._ran_on.pop(call_id, ""))
        if worker is not None:  # its slot is free, whatever became of its job
            worker.running.discard(call_id)
            worker.training.discard(call_id)
            if call is not None:
                self.ledger.call_finished(worker.worker_id, call.job_id, now)
        job = self._jobs.get(call.job_id) if call is not None else None
        if call is None or job is None:
            return  # already failed (its worker was declared lost first), or its job is gone
        job.running[call.lane].discard(call_id)
        job.unfinished.discard(call_id)
        job.barriers.discard(call_id)
        if call.lane in self._state_lanes(job):
            job.state.last_done_s = now

    def _cancel(self, call_id: int) -> None:
        call = self._calls.get(call_id)
        job = self._jobs.get(call.job_id) if call is not None else None
        if job is not None and call is not None and call_id in job.queues[call.lane]:
            job.queues[call.lane].remove(call_id)
            job.unfinished.discard(call_id)
            job.barriers.discard(call_id)
            del self._calls[call_id]

    def _enqueue(self, job: _ScheduledJob, call: _Call) -> None:
        """Into its lane's queue, which stays in the job's order (a front call goes first)."""
        bisect.insort(job.queues[call.lane], call.call_id, key=lambda c: self._calls[c].seq)

    def _lose_worker(self, worker_id: str, reason: str, now: float) -> list[Action]:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return []
        self._rollout_ids.discard(worker_id)
        self._moving_workers.discard(worker_id)
        self._replicas.pop(worker_id, None)
        if worker.swapping is not None:
            self._swapping.pop(worker.swapping.job_id, None)
        actions: list[Action] = []
        survivors: set[str] = set()  # other members of its groups: their slots and memory are free now
        for call_id in sorted(worker.running):
            call = self._calls.get(call_id)
            job = self._jobs.get(call.job_id) if call is not None else None
            if call is None or job is None or not job.pooled or call.lane != SAMPLER or job.home == worker_id:
                continue
            job.running[SAMPLER].discard(call_id)
            self._ran_on.pop(call_id, None)
            self._started.pop(call_id, None)
            self.ledger.call_finished(worker_id, job.job_id, now)
            self._enqueue(job, call)  # a pooled turn that ran there goes back to its queue
        for job_id in sorted(worker.jobs | worker.samplers):
            job = self._jobs[job_id]
            if job.lost is not None:
                continue  # lost already (its restore failed): nothing of it to recover
            lost = f"worker {worker_id} holding job {job_id}'s state was lost ({reason})"
            opening = any(self._calls[c].kind == "open" for c in job.unfinished)  # no state exists yet
            if job.members:  # a group lives or dies as a unit: its other shards are of no use alone
                survivors.update(self._disband(job, now, requeue=job.recoverable or opening))
                job.home = job.sampler = worker_id
            if (job.recoverable or opening) and job.sampler == job.home == worker_id:
                actions += self._recover(job, worker_id, lost, now)
            else:
                actions += self._lose_job(job, WorkerLostError(f"{lost}; {LOST}"), now)
        homes = {a.worker_id for a in actions if isinstance(a, Recover) and a.worker_id} | survivors
        for job_id in sorted(self._pooled):  # queued turns go to the rollout workers left (or their homes)
            queued = self._jobs[job_id].queues[SAMPLER]
            homes |= {w for c in queued for w in self._lane_workers(self._calls[c])}
        for home in sorted(
            homes & self._workers.keys()
        ):  # a re-queued restore starts there (a new one is submitted and starts then)
            actions += self._dispatch(self._workers[home], now)
        return actions

    def _recover(self, job: _ScheduledJob, lost_worker: str, lost: str, now: float) -> list[Action]:
        """A job whose worker was lost lives on: its running calls are queued again, behind a
        ``restore`` (the one already pending, if any) on a new home, or behind its own ``open``
        if it never finished opening (nothing of it existed: opening it there is all it takes)."""
        for lane in (SAMPLER, TRAINER):
            for call_id in sorted(job.running[lane]):
                if self._ran_on.get(call_id, lost_worker) != lost_worker:
                    continue  # a pooled turn on a rollout worker runs on
                self._enqueue(job, self._calls[call_id])
                self._ran_on.pop(call_id, None)
                self._started.pop(call_id, None)
                self.ledger.call_finished(lost_worker, job.job_id, now)
                job.running[lane].discard(call_id)
        self._waiting.discard(job.job_id)
        job.home = job.sampler = ""
        job.state = Residency(job.state.state_bytes, rs.HOST)  # made on the device by its restore (or open)
        job.rebuilding = "open" not in {self._calls[c].kind for c in job.unfinished}
        self._homeless[job.job_id] = (now, lost)
        actions = self._rehome(job, now)
        return actions or [Recover(job.job_id, "", restore=False)]  # it waits for a worker

    def _rehome_waiting(self, now: float) -> list[Action]:
        """Place the jobs waiting for a worker where one can take them now (a worker joined, or a
        job closed and freed one), and start their calls there."""
        actions: list[Action] = []
        for job_id in sorted(self._homeless):
            actions += self._rehome(self._jobs[job_id], now)
        homes = {a.worker_id for a in actions if isinstance(a, Recover) and a.worker_id}
        for home in sorted(homes):
            actions += self._dispatch(self._workers[home], now)
        return actions

    def _rehome(self, job: _ScheduledJob, now: float) -> list[Action]:
        """Place a job that lost its worker, if a worker can take it now."""
        if job.devices > 1:
            return self._rehome_group(job, now)
        chosen = self._choose(job, False, now)
        if isinstance(chosen, NoWorkersError):
            return []
        del self._homeless[job.job_id]
        self._home(chosen, job)
        job.sampler = chosen.worker_id
        # A pooled job's replica there (a worker lent to rollout, and back): its home now.
        released: list[Action] = []
        if self._replicas.get(chosen.worker_id, {}).pop(job.job_id, None) is not None:
            released.append(Release(chosen.worker_id, job.job_id))
        return [*released, Recover(job.job_id, chosen.worker_id, restore=self._restores(job, now))]

    def _restores(self, job: _ScheduledJob, now: float) -> bool:
        """Queue a ``restore`` ahead of the re-homed job's calls, unless one is pending or it never
        opened (its ``open`` makes it): whether it did."""
        if {self._calls[c].kind for c in job.unfinished} & MAKES_STATE:
            return False
        self._queue_own(job, "restore", now)
        return True

    def _queue_own(self, job: _ScheduledJob, kind: CallKind, now: float, after: _Call | None = None) -> None:
        """Submit a call of the scheduler's own for ``job``: ahead of its other calls, or in the place
        of the call ``after`` (just done) on its sampler worker."""
        assert job.lost is None, f"no call of its own for lost job {job.job_id}"
        call_id = next(self._own_ids)
        self._own[call_id] = OwnCall(job.job_id, kind, follows=after.call_id if after is not None else 0)
        call = self._new_call(call_id, job.job_id, kind, 0, front=after is None)
        if after is not None:
            call = replace(call, seq=after.seq, lane=SAMPLER)
        self._submit(call, now)

    def follows_on(self, call_id: int) -> bool:
        """The call, if it ends well, goes on as a call of the scheduler's own on its job's sampler
        worker (``_follow_on``): its caller hears once that one is done."""
        call = self._calls.get(call_id)
        job = self._jobs.get(call.job_id) if call is not None else None
        if call is None or job is None or call_id in self._own or call.kind not in FOLLOW_ON:
            return False
        return job.sampler != job.home and not job.members and job.sampler in self._workers

    def _follow_on(self, done: _Call, now: float) -> None:
        """A disaggregated job's barrier ended well on its home: its sampler worker does its part next,
        in the barrier's place (nothing of the job passes it)."""
        job = self._jobs[done.job_id]
        self._queue_own(job, FOLLOW_ON[done.kind], now, after=done)

    def _lose_job(self, job: _ScheduledJob, error: PlexError, now: float) -> list[Action]:
        """The job cannot go on: fail its calls (and every later one) with ``error``; the slots
        its running calls held on surviving workers may start other jobs' calls."""
        job.lost = error
        self._homeless.pop(job.job_id, None)
        actions: list[Action] = []
        for call_id in sorted(job.unfinished):
            self._calls.pop(call_id, None)
            self._own.pop(call_id, None)
            actions.append(Fail(job.job_id, call_id, error))
        freed: set[str] = set()
        for lane in (SAMPLER, TRAINER):
            for call_id in job.running[lane]:
                self._started.pop(call_id, None)
                freed.update(self._release_gang(call_id, now))
                worker_id = self._ran_on.pop(call_id, None)
                other = self._workers.get(worker_id) if worker_id is not None else None
                if other is not None:
                    other.running.discard(call_id)
                    other.training.discard(call_id)
                    self.ledger.call_finished(other.worker_id, job.job_id, now)
                    freed.add(other.worker_id)
            job.queues[lane].clear()
            job.running[lane].clear()
        job.unfinished.clear()
        job.barriers.clear()
        self._waiting.discard(job.job_id)
        actions.append(JobLost(job.job_id, error))
        for worker_id in sorted(freed):
            actions += self._dispatch(self._workers[worker_id], now)
        return actions

    def _dispatch(self, worker: _Worker, now: float) -> list[Action]:
        """Start what ``worker`` can start, and move state in or out (or switch its engines) for
        what cannot start yet."""
        actions: list[Action] = []
        if worker.used_bytes > worker.budget and worker.swapping is None:  # a job outgrew the budget (or a base came)
            victim = self._victim(worker, None, now)
            if victim is not None:
                actions += self._evict(worker, victim)
        entries = self._entries(worker, now)
        gate = self._engine_gate(worker, entries, now)
        for job, startable in entries:
            if job.members:
                actions += self._dispatch_group(job, startable, now)
                continue
            if worker.gang:
                continue  # a group claims the worker: its call runs here or waits for the worker to drain
            # Lanes on the job's home need its state on the device (closing frees it wherever it
            # is); a disaggregated job's sampler lane runs on the replica of its sampler worker.
            first = startable[0]
            if job.rebuilding and first.kind != "restore":
                continue  # its state exists nowhere until the restore (submitted next) makes it
            needs_state = self.needs_state(job, first.lane, worker)
            room = self._room(worker, job.state.state_bytes)
            if needs_state and first.kind in MAKES_STATE and job.state.tier == rs.HOST and room:
                # Its state does not exist yet: the open makes it on the device, so it needs room
                # there, not a transfer (a move in would reach a worker that has nothing to move).
                job.state.tier = rs.DEVICE
                worker.used_bytes += job.state.state_bytes
            if self.waits_for_move(job, first, worker):
                actions += self._bring_in(worker, job, room, now)
                continue
            for call in startable:
                if not self._may_start(worker, job, call, gate):
                    break
                actions += self._replicate(worker, job, call)
                actions.append(self._start(worker, job, call, needs_state, now))
        worker.wanted, worker.wanted_for = gate.want, gate.want_for
        if gate.want and now - worker.engines_since >= worker.switch_s and not self._holds_engines(worker):
            actions.append(self._move_engines(worker, gate.want))
        return actions

    def _entries(self, worker: _Worker, now: float) -> list[tuple[_ScheduledJob, list[_Call]]]:
        """Each job's calls that may start on ``worker`` now, the jobs in the policy's order."""
        entries: list[tuple[_ScheduledJob, list[_Call]]] = []
        away = bool(self._rollout_ids)  # pooled jobs' turns run there
        for job_id in worker.jobs | worker.samplers:
            job = self._jobs[job_id]
            for lane in job.lanes_on(worker.worker_id, job.pooled and away):
                startable = self._startable(job, lane)
                if startable:
                    entries.append((job, startable))
        if self._takes_turns(worker) and self._pooled:
            buckets: dict[int, bool] = {}  # each bucket (ascending): whether a worker of it has a free slot
            for w in sorted(self._rollout(), key=lambda w: w.bucket):
                buckets[w.bucket] = buckets.get(w.bucket, False) or len(w.running) < w.slots
            for job_id in self._pooled:
                job = self._jobs[job_id]
                turns = [c for c in self._startable(job, SAMPLER) if self._takes_turn(worker, buckets, job, c)]
                if turns:
                    entries.append((job, turns))
        if len(entries) > 1:
            entries.sort(key=lambda e: self.policy.rank(self, worker, e[0], e[1][0], now))
        return entries

    def _may_start(self, worker: _Worker, job: _ScheduledJob, call: _Call, gate: _EngineGate) -> bool:
        """``call`` has a slot on ``worker`` (a trainer slot if it takes one) and its engines are in
        the state it needs; a call needing the other state is noted in ``gate`` (the first one)."""
        if len(worker.running) >= worker.slots:
            return False
        if worker.takes_trainer_slot(call) and len(worker.training) >= worker.trainer_slots:
            return False
        need = self._engines_need(worker, call)
        if need and (not gate.settled or need != worker.engines or gate.draining):
            if gate.settled and need != worker.engines and not gate.want:
                gate.want, gate.want_for = need, job.job_id
            return False
        return True

    def _start(self, worker: _Worker, job: _ScheduledJob, call: _Call, needs_state: bool, now: float) -> Dispatch:
        """Run ``call`` on ``worker`` now: its slot taken, its start charged."""
        if needs_state:
            job.state.waiting_since_s = None
            self._waiting.discard(job.job_id)
        job.queues[call.lane].remove(call.call_id)
        job.running[call.lane].add(call.call_id)
        job.rebuilding &= call.kind != "restore"
        worker.running.add(call.call_id)
        self._ran_on[call.call_id] = worker.worker_id
        if worker.takes_trainer_slot(call):
            worker.training.add(call.call_id)
        pooled_turn = job.pooled and call.lane == SAMPLER
        if pooled_turn:
            self._started[call.call_id] = now
        self.ledger.call_started(worker.worker_id, job.job_id, now)
        # A pooled turn's engine priority is its level (lower runs first): the MLFQ inside a bucket.
        priority = call.level if pooled_turn else call.priority
        exclusive = call.lane == TRAINER and self._turns_left_on(worker)
        return Dispatch(call.call_id, worker.worker_id, priority, exclusive, own=self._own.get(call.call_id))

    def _bring_in(self, worker: _Worker, job: _ScheduledJob, room: bool, now: float) -> list[Action]:
        """``job``'s next call waits for its state: move it in if there is room, else move another
        job's out if one should go (one transfer at a time per worker)."""
        if job.state.waiting_since_s is None:
            job.state.waiting_since_s = now
            self._waiting.add(job.job_id)
        if worker.swapping is not None or job.state.tier != rs.HOST:
            return []
        if room:
            return [self._swap(worker, job, rs.DEVICE)]
        victim = self._victim(worker, job, now)
        return self._evict(worker, victim) if victim is not None else []

    def _engine_gate(
        self, worker: _Worker, entries: list[tuple[_ScheduledJob, list[_Call]]], now: float
    ) -> _EngineGate:
        """Its engines switch state when a call needs them in the other one: calls needing the state
        they are in stop starting once they have been in it as long as a switch round costs."""
        want, want_for = self._wanted(worker, entries)
        draining = bool(want) and now - worker.engines_since >= worker.switch_s
        return _EngineGate(worker.engines in (AWAKE, ASLEEP), draining, want, want_for)

    # -- a worker's vLLM engines: asleep while its training needs their memory, awake to sample ----

    def _engines_need(self, worker: _Worker, call: _Call) -> EngineState | Literal[""]:
        """The state ``call`` needs ``worker``'s engines in ("": either). A training call needs them
        asleep when the plan says it does not fit beside them; a save needs nothing of them; every
        other call samples or changes what they serve, so it needs them awake."""
        if call.kind in TRAINING_KINDS:
            return ASLEEP if worker.must_sleep() else ""
        return "" if call.kind == "save" or worker.plan is None else AWAKE

    def _wanted(
        self, worker: _Worker, entries: list[tuple[_ScheduledJob, list[_Call]]]
    ) -> tuple[EngineState | Literal[""], str]:
        """The other state than theirs that the first startable call (in rank order) needing one
        needs ``worker``'s engines in, and its job; ("", "") if none."""
        if worker.engines not in (AWAKE, ASLEEP):
            return "", ""
        for job, startable in entries:
            first = startable[0]
            if job.members or worker.gang or (job.rebuilding and first.kind != "restore"):
                continue
            if self.waits_for_move(job, first, worker):
                continue
            for call in startable:
                need = self._engines_need(worker, call)
                if need and need != worker.engines:
                    return need, job.job_id
        return "", ""

    def _holds_engines(self, worker: _Worker) -> bool:
        """A running call keeps ``worker``'s engines as they are: while awake, one that samples or
        changes what they serve; while asleep, a training call (its activations use their memory)."""
        for call_id in worker.running:
            call = self._calls.get(call_id)
            if call is None:
                continue
            training = call.kind in TRAINING_KINDS
            if (worker.engines == ASLEEP and training) or (
                worker.engines == AWAKE and not training and call.kind != "save"
            ):
                return True
        return False

    def _move_engines(self, worker: _Worker, to: EngineState) -> MoveEngines:
        assert worker.plan is not None  # only a planned worker's training asks for a sleep
        engines = worker.fixed_bytes("engine")
        if to == ASLEEP:
            worker.engines_level = sleep_level(worker.plan, engines)
        worker.engines = TO_SLEEP if to == ASLEEP else TO_WAKE
        worker.engines_for, worker.wanted, worker.wanted_for = worker.wanted_for, "", ""
        return MoveEngines(worker.worker_id, to, worker.engines_level, engines, worker.engines_for)

    def _engines_moved(self, worker_id: str, seconds: float, ok: bool, now: float) -> str | None:
        """A switch of ``worker_id``'s engines is done: charged to the job whose call asked for it,
        like a state move. A failed one leaves them awake, and they are not put to sleep again."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.engines not in (TO_SLEEP, TO_WAKE):
            return None
        slept = worker.engines == TO_SLEEP
        worker.engines = ASLEEP if slept and ok else AWAKE
        worker.sleep_failed |= not ok
        worker.engines_since = now
        if slept:
            worker.sleep_s = seconds
        else:
            worker.wake_s = seconds
        self.ledger.swapped(worker.engines_for, worker.fixed_bytes("engine"), seconds)
        worker.engines_for = ""
        return worker_id

    def _room(self, worker: _Worker, size: int) -> bool:
        """Whether ``size`` more bytes of state fit ``worker``'s device now: within its budget, and,
        while a training call runs beside its awake engines, beside both."""
        if worker.used_bytes + size > worker.budget:
            return False
        if worker.plan is None or worker.engines == ASLEEP:
            return True
        training = any(c in self._calls and self._calls[c].kind in TRAINING_KINDS for c in worker.running)
        both = sum(worker.parts())
        return not training or worker.used_bytes + size + both <= free_bytes(worker.plan)

    def _turns_left_on(self, worker: _Worker) -> bool:
        """Whether a worker taken back for training still runs turns from its time in rollout."""
        if "train" not in (worker.role, worker.moving_to):
            return False
        return any(c in self._calls and self._calls[c].lane == SAMPLER for c in worker.running)

    def _startable(self, job: _ScheduledJob, lane: Lane) -> list[_Call]:
        """The calls of ``job``'s ``lane`` that may start now, in the order they should.

        Trainer lane: its head, when nothing of the lane runs; a barrier only once every earlier
        call of the job is done. Sampler lane: queued generates ahead of the first unfinished
        barrier, lowest priority value first (frontier groups), then oldest. "Earlier" is the job's
        order (``_Call.seq``): submission order, with a ``restore`` ahead of everything.
        """
        queue = job.queues[lane]
        if not queue:
            return []
        first_barrier = min((self._calls[c].seq for c in job.barriers), default=None)
        if lane == TRAINER:
            if job.running[TRAINER]:
                return []
            call = self._calls[queue[0]]
            if call.kind in BARRIERS:
                return [call] if min(self._calls[c].seq for c in job.unfinished) == call.seq else []
            return [call] if first_barrier is None or call.seq < first_barrier else []
        head = self._calls[queue[0]]
        if head.kind in BARRIERS:  # a disaggregated job's follow-on: its barrier's part on this worker
            return [head] if min(self._calls[c].seq for c in job.unfinished) == head.seq else []
        calls = [self._calls[c] for c in queue if first_barrier is None or self._calls[c].seq < first_barrier]
        return sorted(calls, key=lambda c: (c.level, c.priority, c.seq))

    def _victim(self, worker: _Worker, waiting: _ScheduledJob | None, now: float) -> _ScheduledJob | None:
        """The resident, idle job to move out so ``waiting`` can come in (or, with ``waiting`` None,
        so the device gets back under its budget), if any should go now. A closing job is not
        moved: its close frees its state (seen when a close had finished on the worker but the
        job's ``JobClosed`` was not handled yet: the move reached a worker that no longer had it)."""
        idle = [
            job
            for job in (self._jobs[j] for j in sorted(worker.jobs))
            if job.state.tier == rs.DEVICE
            and job.idle_on(worker.worker_id, sampler_apart=not self.needs_state(job, SAMPLER, worker))
            # A pooled turn on its home (a worker moved to rollout) keeps it, unless generates there use no state.
            and (worker.stateless_generates or not job.running[SAMPLER] & worker.running)
            and not job.closing
        ]
        return self.policy.victim(self, worker, idle, waiting, now) if idle else None

    def _swap(self, worker: _Worker, job: _ScheduledJob, to: Tier) -> Swap:
        size = job.state.state_bytes
        worker.swapping = _SwapInFlight(job.job_id, to, size)
        self._swapping[job.job_id] = worker.worker_id
        job.state.tier = rs.TO_DEVICE if to == rs.DEVICE else rs.TO_HOST
        if to == rs.DEVICE:
            worker.used_bytes += size  # reserved now, so nothing else takes the room
        return Swap(job.job_id, worker.worker_id, to, size)

    def _swap_done(self, job_id: str, seconds: float, moved_bytes: int | None, ok: bool) -> str | None:
        worker_id = self._swapping.pop(job_id, None)
        worker = self._workers.get(worker_id) if worker_id is not None else None
        if worker is None or worker.swapping is None or worker.swapping.job_id != job_id:
            return None
        move, worker.swapping = worker.swapping, None
        moved = move.state_bytes if moved_bytes is None else moved_bytes
        if ok and seconds > 0 and moved > 0:  # measured bandwidth refines the cost model
            worker.bytes_per_s = 0.5 * worker.bytes_per_s + 0.5 * moved / seconds
        self.ledger.swapped(job_id, moved, seconds)
        job = self._jobs.get(job_id)
        on_device = (move.to == rs.DEVICE) == ok  # a failed move leaves the state where it was
        if job is None or not on_device:  # its room is free again (a move in reserved it up front)
            worker.used_bytes -= move.state_bytes
        if job is not None:
            job.state.tier = rs.DEVICE if on_device else rs.HOST
        return worker.worker_id

    # -- worker groups (a job on several devices: groups.py places it, its calls run as a gang) ----

    def _place_group(
        self, job_id: str, state_bytes: int, weight: float, base: str, devices: int, elsewhere: bool, now: float
    ) -> list[Action]:
        """Place a group job on an aligned block of ``devices`` workers with room for its shard."""
        if devices not in groups.GROUP_SIZES or elsewhere:
            why = (
                f"job {job_id} asks for {devices} devices{' and generates elsewhere' if elsewhere else ''}: a job "
                f"spans {', '.join(map(str, groups.GROUP_SIZES))} devices and generates on its own group"
            )
            return [Fail(job_id, None, NoWorkersError(why))]
        job = _ScheduledJob(
            job_id, "", Residency(state_bytes, rs.HOST), weight=weight if weight > 0 else 1.0, base=base
        )
        job.devices = devices
        if not self._homes():  # none registered yet: it waits for a group, as a job whose worker was lost
            self._jobs[job_id] = job
            self.ledger.job_opened(job_id, now)
            self._homeless[job_id] = (now, f"job {job_id} opened with no worker registered")
            return [Place(job_id, "")]
        chosen = self._choose_group(state_bytes, devices)
        if isinstance(chosen, NoWorkersError):
            return [Fail(job_id, None, chosen)]
        fits = all(w.used_bytes + state_bytes <= w.budget for w in chosen)
        job.state.tier = rs.DEVICE if fits else rs.HOST
        self._seat(job, chosen)
        self._jobs[job_id] = job
        self.ledger.job_opened(job_id, now)
        return [Place(job_id, job.home, "", members=job.members)]

    def _choose_group(self, state_bytes: int, devices: int) -> list[_Worker] | NoWorkersError:
        """The least loaded aligned block whose members' budgets hold a shard (``dedicated``: a free one)."""
        blocks = [b for b in groups.aligned_blocks(self._homes(), devices) if all(state_bytes <= w.budget for w in b)]
        if self.policy.name == "dedicated":
            blocks = [b for b in blocks if not any(w.jobs or w.samplers for w in b)]
        if not blocks:
            return NoWorkersError(
                f"no aligned block of {devices} workers on one node (indices i..i+{devices - 1}, i a multiple of "
                f"{devices}) is free for a shard of {state_bytes} bytes: start workers with --node and --index, "
                "close a job, or ask for fewer devices"
            )
        return list(groups.least_loaded(blocks, lambda w: len(w.jobs) + len(w.samplers)))

    def _seat(self, job: _ScheduledJob, members: list[_Worker]) -> None:
        job.members = tuple(w.worker_id for w in members)
        job.home = job.sampler = job.members[0]
        for w in members:
            w.jobs.add(job.job_id)
            if job.state.tier == rs.DEVICE:
                w.used_bytes += job.state.state_bytes

    def _rehome_group(self, job: _ScheduledJob, now: float) -> list[Action]:
        """Place a group job that lost a member on a whole new block, if one can take it now."""
        chosen = self._choose_group(job.state.state_bytes, job.devices)
        if isinstance(chosen, NoWorkersError):
            return []
        del self._homeless[job.job_id]
        self._seat(job, chosen)  # its state is in host memory (or nowhere): made on the block by its restore
        return [Recover(job.job_id, job.home, restore=self._restores(job, now), members=job.members)]

    def _dispatch_group(self, job: _ScheduledJob, startable: list[_Call], now: float) -> list[Action]:
        """Start the group's next call on all its members at once, or bring its shards in on all of them."""
        members = [self._workers[m] for m in job.members]
        first, size = startable[0], job.state.state_bytes
        if job.rebuilding and first.kind != "restore":
            return []
        room = all(w.used_bytes + size <= w.budget for w in members)
        if first.kind in MAKES_STATE and job.state.tier == rs.HOST and room:
            job.state.tier = rs.DEVICE  # the open (or restore) makes each shard on its member
            for w in members:
                w.used_bytes += size
        if job.state.tier == rs.DEVICE or (first.kind == "close" and job.state.tier == rs.HOST):
            job.state.waiting_since_s = None
            self._waiting.discard(job.job_id)
            return self._start_gang(job, members, first, now)
        if job.state.waiting_since_s is None:
            job.state.waiting_since_s = now
            self._waiting.add(job.job_id)
        if job.state.tier != rs.HOST:
            return []  # moving
        if room:
            return self._swap_group(job, rs.DEVICE)
        actions: list[Action] = []
        for w in members:  # make room on each member that lacks it
            if w.swapping is None and w.used_bytes + size > w.budget:
                victim = self._victim(w, job, now)
                if victim is not None:
                    actions += self._evict(w, victim)
        return actions

    def _start_gang(self, job: _ScheduledJob, members: list[_Worker], call: _Call, now: float) -> list[Action]:
        """Claim every member (all or none: another group's claim comes first), and start ``call``
        once all have drained; the claim holds until the call ends."""
        if any(w.gang not in ("", job.job_id) for w in members):
            return []
        for w in members:
            w.gang = job.job_id
        if any(w.running for w in members):
            return []
        job.queues[call.lane].remove(call.call_id)
        job.running[call.lane].add(call.call_id)
        job.rebuilding &= call.kind != "restore"
        for w in members:
            w.running.add(call.call_id)
            if w.takes_trainer_slot(call):
                w.training.add(call.call_id)
            self.ledger.call_started(w.worker_id, job.job_id, now)
        self._ran_on[call.call_id] = job.home
        self._gangs[call.call_id] = (job.job_id, job.members)
        return [Dispatch(call.call_id, job.home, call.priority, own=self._own.get(call.call_id))]

    def _release_gang(self, call_id: int, now: float) -> list[str]:
        """Free a group call's slots on the members other than its leader (whose slot is freed as any
        call's) and the group's claim on all; the members freed."""
        job_id, members = self._gangs.pop(call_id, ("", ()))
        for member in members[1:]:
            self.ledger.call_finished(member, job_id, now)
            worker = self._workers.get(member)
            if worker is not None:
                worker.running.discard(call_id)
                worker.training.discard(call_id)
        for member in members:
            worker = self._workers.get(member)
            if worker is not None and worker.gang == job_id:
                worker.gang = ""
        return [m for m in members if m in self._workers]

    def _unclaim(self, job: _ScheduledJob) -> list[str]:
        """Drop the group's claim on its members if none of its calls runs (its ready call went away)."""
        if any(job.running.values()):
            return []
        for member in job.members:
            worker = self._workers.get(member)
            if worker is not None and worker.gang == job.job_id:
                worker.gang = ""
        return [m for m in job.members if m in self._workers]

    def _disband(self, job: _ScheduledJob, now: float, requeue: bool = False) -> list[str]:
        """Take a group job off its members (it closed, or lost a member): free each member's shard,
        slots and claim; its running calls go back to its queues (``requeue``) or are left unfinished
        (for ``_lose_job`` to fail). Returns the members still registered."""
        self._group_swaps.pop(job.job_id, None)
        self._swapping.pop(job.job_id, None)
        for lane in (SAMPLER, TRAINER):
            for call_id in sorted(job.running[lane]):
                self._release_gang(call_id, now)
                leader = self._ran_on.pop(call_id, job.home)
                self.ledger.call_finished(leader, job.job_id, now)
                if leader in self._workers:
                    self._workers[leader].running.discard(call_id)
                    self._workers[leader].training.discard(call_id)
                job.running[lane].discard(call_id)
                if requeue:
                    self._enqueue(job, self._calls[call_id])
        survivors = [self._workers[m] for m in job.members if m in self._workers]
        for w in survivors:
            if job.state.tier != rs.HOST:  # on the device, or on its way in or out: counted there
                w.used_bytes -= job.state.state_bytes
            if w.swapping is not None and w.swapping.job_id == job.job_id:
                w.swapping = None  # its SwapDone, when it comes, finds no move to settle
            w.jobs.discard(job.job_id)
            if w.gang == job.job_id:
                w.gang = ""
        job.members = ()
        job.state.tier = rs.HOST
        return [w.worker_id for w in survivors]

    def _evict(self, worker: _Worker, victim: _ScheduledJob) -> list[Action]:
        """Move ``victim``'s state off ``worker`` (a group's off all its members, once none is moving)."""
        if not victim.members:
            return [self._swap(worker, victim, rs.HOST)]
        return self._swap_group(victim, rs.HOST)

    def _swap_group(self, job: _ScheduledJob, to: Tier) -> list[Action]:
        """Move a group job's shards on all its members at once (none if one of them is moving)."""
        members = [self._workers[m] for m in job.members]
        if any(w.swapping is not None for w in members):
            return []
        self._group_swaps[job.job_id] = _GroupSwap(to, set(job.members))
        return [self._swap(w, job, to) for w in members]

    def _group_swap_done(
        self, job_id: str, worker_id: str, seconds: float, moved_bytes: int | None, ok: bool
    ) -> list[str]:
        """One member's shard moved; once all have, the group's state is where they all put it (any
        failure: where it was, everywhere). Returns the members that may start calls now."""
        group_move = self._group_swaps[job_id]
        worker = self._workers.get(worker_id)
        if worker is None or worker.swapping is None or worker.swapping.job_id != job_id:
            return []
        move, worker.swapping = worker.swapping, None
        group_move.pending.discard(worker_id)
        group_move.ok &= ok
        moved = move.state_bytes if moved_bytes is None else moved_bytes
        if ok and seconds > 0 and moved > 0:
            worker.bytes_per_s = 0.5 * worker.bytes_per_s + 0.5 * moved / seconds
        self.ledger.swapped(job_id, moved, seconds)
        if group_move.pending:
            return [worker_id]  # it may start other jobs' calls meanwhile
        del self._group_swaps[job_id]
        self._swapping.pop(job_id, None)
        job = self._jobs.get(job_id)
        on_device = (group_move.to == rs.DEVICE) == group_move.ok
        members = [self._workers[m] for m in (job.members if job is not None else ()) if m in self._workers]
        for w in members:
            if not on_device:
                w.used_bytes -= move.state_bytes
        if job is not None:
            job.state.tier = rs.DEVICE if on_device else rs.HOST
        return [w.worker_id for w in members] or [worker_id]
