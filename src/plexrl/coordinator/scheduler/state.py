"""The scheduler's records (workers, jobs, calls) and the tables its parts share."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from plexrl.coordinator.accounting import Ledger
from plexrl.coordinator.buckets import Trajectories
from plexrl.coordinator.events import OwnCall
from plexrl.coordinator.policies import Policy
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.residency import DEVICE, HOST, Residency
from plexrl.errors import PlexError
from plexrl.names import CallKind, EngineState, Lane, Role, Tier
from plexrl.plan import JobShape, WorkerPlan, footprint, free_bytes, held_bytes, must_sleep

AWAKE: EngineState = "awake"  # a worker's vLLM engines
ASLEEP: EngineState = "asleep"
TO_SLEEP: EngineState = "to_sleep"
TO_WAKE: EngineState = "to_wake"

SAMPLER: Lane = "sampler"
TRAINER: Lane = "trainer"
BARRIERS: frozenset[CallKind] = frozenset({"open", "close", "sync_weights", "load", "restore", "set_weights"})
# A disaggregated job's barrier done on its home continues on its sampler worker (``Recovery.follow_on``):
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


@dataclass(frozen=True, slots=True)
class SwapInFlight:
    job_id: str
    to: Tier
    state_bytes: int


@dataclass(slots=True)
class ScheduledWorker:
    worker_id: str
    slots: int
    memory_bytes: float = math.inf
    bytes_per_s: float = 10e9
    used_bytes: int = 0  # state on the device or on its way there (or still leaving)
    swapping: SwapInFlight | None = None  # the one transfer in flight on this worker
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
    lent_to: str = ""  # a rollout worker that joined this job's training (``Elastic.widen``): it takes no turns
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

    def takes_trainer_slot(self, call: ScheduledCall) -> bool:
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


@dataclass(slots=True)
class ScheduledJob:
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
    step_open: bool = False  # a forward_backward ran since its last optim_step (gradients wait on its workers)

    @property
    def elastic(self) -> bool:
        """A one-device job widened to rollout workers for its training (``Elastic.widen``): its
        trainer lane runs on ``members`` as a gang, its generates as before."""
        return self.devices == 1 and bool(self.members)

    def lanes_on(self, worker_id: str, pooled_away: bool = False) -> list[Lane]:
        """Its lanes that run on ``worker_id``; ``pooled_away``: its generates run on rollout workers."""
        if self.members and not self.elastic:
            return [TRAINER, SAMPLER] if worker_id in self.members else []
        trainers = self.members or (self.home,)
        lanes: list[Lane] = [TRAINER] if worker_id in trainers else []
        return lanes + ([SAMPLER] if self.sampler == worker_id and not pooled_away else [])

    def idle_on(self, worker_id: str, sampler_apart: bool = False) -> bool:
        """Nothing of it queued or running on ``worker_id`` (``sampler_apart``: nothing but generates,
        which need none of its state there)."""
        return not any(self.queues[lane] or self.running[lane] for lane in self.lanes_on(worker_id, sampler_apart))


@dataclass(frozen=True, slots=True)
class ScheduledCall:
    call_id: int
    job_id: str
    kind: CallKind
    priority: int = 0
    seq: int = 0  # its place in its job's order: the call id, or below every other for a front call
    trajectory: str = ""  # a pooled job's turn: its trajectory
    level: int = 0  # and that trajectory's level when the turn was submitted
    lane: Lane = TRAINER  # generates: SAMPLER; so is a disaggregated job's follow-on (``Recovery.follow_on``)


@dataclass(slots=True)
class Replica:
    """A pooled job's sampler on a rollout worker: the version of its weights it serves and what
    it holds there (counted in the worker's ``used_bytes``; its base's parts in ``fixed``)."""

    epoch: int
    held_bytes: int
    last_s: float  # when its last turn there started: the least recently used goes first


@dataclass(slots=True)
class GroupSwap:
    """A group job's state moving on every member: done when the last member reports."""

    to: Tier
    pending: set[str]
    ok: bool = True


@dataclass(frozen=True, slots=True)
class JobView:
    """What the coordinator's book and reports read of a job (the scheduler's own record is private)."""

    home: str  # its home worker ("": it waits for one)
    sampler: str  # a disaggregated job's sampler worker ("": its generates run at home, or pooled)
    pooled: bool  # its generates run on the rollout workers
    recoverable: bool  # rebuilt on another worker when its home is lost
    closing: bool  # its close is submitted
    lost: PlexError | None  # why it cannot go on (None: it can)
    members: tuple[str, ...] = ()  # a gang job's workers, its home first (() : one device)


@dataclass(slots=True)
class Tables:
    """Every record the scheduler keeps, by id, with the indexes kept over them; the parts of the
    scheduler (``dispatch``, ``swaps``, ``pool``, ...) share one. Policies see it as ``SchedulerFacts``."""

    policy: Policy
    trajectories: Trajectories
    rebalancer: Rebalancer | None  # moves home workers between training and rollout (None: roles stay)
    recovery_wait_s: float  # a job whose worker was lost waits this long for another
    ledger: Ledger = field(default_factory=Ledger)
    registered: dict[str, ScheduledWorker] = field(default_factory=dict)  # workers by id
    jobs: dict[str, ScheduledJob] = field(default_factory=dict)
    calls: dict[int, ScheduledCall] = field(default_factory=dict)  # unfinished calls
    ran_on: dict[int, str] = field(default_factory=dict)  # running call -> the worker it runs on (its slot)
    swapping: dict[str, str] = field(default_factory=dict)  # job -> worker, for state in transit
    waiting: set[str] = field(default_factory=set)  # jobs with a ready call whose state is not on the device
    homeless: dict[str, tuple[float, str]] = field(default_factory=dict)  # job -> (since, why): no worker took it
    pooled: set[str] = field(default_factory=set)  # pooled jobs
    rollout_ids: set[str] = field(default_factory=set)  # workers taking pooled turns now (``rollout``)
    moving_workers: set[str] = field(default_factory=set)  # workers moving between roles (``Pool.moves_due``)
    started: dict[int, float] = field(default_factory=dict)  # running turn of a pooled job -> when it started
    replicas: dict[str, dict[str, Replica]] = field(default_factory=dict)  # rollout worker -> job -> its replica
    own: dict[int, OwnCall] = field(default_factory=dict)  # unfinished calls of its own (``Recovery.queue_own``)
    own_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(-1, -1))
    gangs: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # group call -> (job, members)
    group_swaps: dict[str, GroupSwap] = field(default_factory=dict)  # group job -> its state's move in flight
    widened: set[str] = field(default_factory=set)  # one-device jobs rollout workers help train (``Elastic``)

    # -- what policies see (``SchedulerFacts``)

    def workers(self) -> list[ScheduledWorker]:
        return list(self.registered.values())

    def job(self, job_id: str) -> ScheduledJob:
        return self.jobs[job_id]

    def waits_for_move(self, job: ScheduledJob, call: ScheduledCall, worker: ScheduledWorker) -> bool:
        """``call`` cannot start on ``worker`` until the job's state is on that device (a close frees
        the state wherever it is)."""
        tier = job.state.tier
        if tier == DEVICE or not self.needs_state(job, call.lane, worker):
            return False
        return not (tier == HOST and call.kind == "close")

    # -- roles

    def homes(self) -> list[ScheduledWorker]:
        """The workers a job's home may be on."""
        return [w for w in self.registered.values() if w.role != "rollout" and w.moving_to != "rollout"]

    def rollout(self) -> list[ScheduledWorker]:
        """The workers taking pooled turns (not one a MoveWorker is taking elsewhere)."""
        return [self.registered[w] for w in sorted(self.rollout_ids)]

    def roles_changed(self, worker: ScheduledWorker) -> None:
        """Keep ``rollout_ids`` (every dispatch asks it: a scan of all workers would cost the
        simulator half its speed on 1024 devices) up to date with ``worker``'s role."""
        if self.takes_turns(worker) and worker.worker_id in self.registered:
            self.rollout_ids.add(worker.worker_id)
        else:
            self.rollout_ids.discard(worker.worker_id)

    @staticmethod
    def takes_turns(worker: ScheduledWorker) -> bool:
        """The worker takes pooled jobs' turns: a rollout worker no move is taking elsewhere, lent
        to no job's training."""
        return worker.role == "rollout" and not worker.moving_to and not worker.lent_to

    def pooled_away(self, job: ScheduledJob) -> bool:
        """The job's generates run on the rollout workers (it is pooled and one is registered)."""
        return job.pooled and bool(self.rollout_ids)

    # -- a job's state and lanes

    def needs_state(self, job: ScheduledJob, lane: Lane, worker: ScheduledWorker) -> bool:
        """Whether ``job``'s ``lane`` running on ``worker`` needs the job's state on that device.
        Every lane on its home does, except generates there when the worker's sampler serves them
        from a copy of the weights of its own (vLLM's adapters: only training waits for a move in)
        or when they are a pooled job's turns and rollout workers take those."""
        if worker.worker_id != job.home:
            return False
        return lane == TRAINER or not (worker.stateless_generates or self.pooled_away(job))

    def state_lanes(self, job: ScheduledJob) -> tuple[Lane, ...]:
        """The lanes whose calls count in the job's idle gaps (residency's break-even rule): both,
        but the generates of a one-device job whose home's sampler needs none of its state."""
        home = self.registered.get(job.home)
        if home is not None and home.stateless_generates and job.devices == 1 and job.sampler == job.home:
            return (TRAINER,)
        return (TRAINER, SAMPLER)

    def enqueue(self, job: ScheduledJob, call: ScheduledCall) -> None:
        """Into its lane's queue, which stays in the job's order (a front call goes first)."""
        bisect.insort(job.queues[call.lane], call.call_id, key=lambda c: self.calls[c].seq)

    def startable(self, job: ScheduledJob, lane: Lane) -> list[ScheduledCall]:
        """The calls of ``job``'s ``lane`` that may start now, in the order they should.

        Trainer lane: its head, when nothing of the lane runs; a barrier only once every earlier
        call of the job is done. Sampler lane: queued generates ahead of the first unfinished
        barrier, lowest priority value first (frontier groups), then oldest. "Earlier" is the job's
        order (``ScheduledCall.seq``): submission order, with a ``restore`` ahead of everything.
        """
        queue = job.queues[lane]
        if not queue:
            return []
        calls = self.calls
        first_barrier = min((calls[c].seq for c in job.barriers), default=None)
        if lane == TRAINER:
            if job.running[TRAINER]:
                return []
            call = calls[queue[0]]
            if call.kind in BARRIERS:
                return [call] if min(calls[c].seq for c in job.unfinished) == call.seq else []
            return [call] if first_barrier is None or call.seq < first_barrier else []
        head = calls[queue[0]]
        if head.kind in BARRIERS:  # a disaggregated job's follow-on: its barrier's part on this worker
            return [head] if min(calls[c].seq for c in job.unfinished) == head.seq else []
        ready = [calls[c] for c in queue if first_barrier is None or calls[c].seq < first_barrier]
        return sorted(ready, key=lambda c: (c.level, c.priority, c.seq))

    # -- what a job fixes on a worker's device (its home, or a rollout worker holding its replica)

    def fixes(self, worker: ScheduledWorker, job: ScheduledJob, alone: bool = False) -> dict[str, int]:
        """What ``job`` on ``worker`` fixes on its device beyond its own bytes, by the plan: a full
        fine-tune job's own engine, and its base's weights, activation headroom and shared engine
        unless another job of that base has put them there (``alone``: as if nothing else had)."""
        if worker.plan is None or job.shape is None:
            return {}
        fp = footprint(worker.plan, job.shape)
        adds = {f"engine:job:{job.job_id}": fp.pinned} if fp.pinned else {}
        if alone or f"weights:{job.base}" not in worker.fixed:
            adds[f"weights:{job.base}"] = fp.parts["base weights"]
            adds[f"activations:{job.base}"] = fp.parts["activations"]
            if fp.parts["shared engine"]:
                adds[f"engine:{job.base}"] = fp.parts["shared engine"]
        return adds

    def unfix(self, worker: ScheduledWorker, job: ScheduledJob) -> None:
        """``job`` left ``worker`` (its home or its replica there): what it fixed there goes, its
        base's parts with the last job of that base the worker homes or holds a replica of."""
        worker.fixed.pop(f"engine:job:{job.job_id}", None)
        others = worker.jobs | self.replicas.get(worker.worker_id, {}).keys()
        if not any(self.jobs[j].base == job.base for j in others if j in self.jobs and j != job.job_id):
            for kind in ("weights", "activations", "engine"):
                worker.fixed.pop(f"{kind}:{job.base}", None)

    def room(self, worker: ScheduledWorker, adds: dict[str, int]) -> float:
        """The room jobs' bytes would have on ``worker`` with ``adds`` fixed there too."""
        if worker.plan is None:
            return worker.memory_bytes
        return min(worker.memory_bytes, free_bytes(worker.plan) - worker.held(worker.fixed | adds))

    def room_alone(self, worker: ScheduledWorker, job: ScheduledJob) -> float:
        """The room ``job``'s bytes would have on ``worker`` were nothing else there (what the job
        itself fixes, its base's parts included, still counts)."""
        if worker.plan is None:
            return worker.memory_bytes
        return min(worker.memory_bytes, free_bytes(worker.plan) - worker.held(self.fixes(worker, job, alone=True)))

    def drop(self, job: ScheduledJob, call: ScheduledCall) -> None:
        """Take a queued call out of its job for good (cancelled, or failed before it started)."""
        job.queues[call.lane].remove(call.call_id)
        job.unfinished.discard(call.call_id)
        job.barriers.discard(call.call_id)
        self.own.pop(call.call_id, None)
        del self.calls[call.call_id]

    # -- slots

    def free(self, call_id: int, job_id: str, now: float) -> list[str]:
        """Free what the running call holds: its slot (a gang call's on every member, with the
        group's claim on them), its end charged. Returns the registered workers it freed."""
        self.started.pop(call_id, None)
        worker_id = self.ran_on.pop(call_id, None)
        _, members = self.gangs.pop(call_id, ("", ()))
        freed: list[str] = []
        for member in members or ((worker_id,) if worker_id is not None else ()):
            self.ledger.call_finished(member, job_id, now)
            worker = self.registered.get(member)
            if worker is None:
                continue
            worker.running.discard(call_id)
            worker.training.discard(call_id)
            if members and worker.gang == job_id:
                worker.gang = ""
            freed.append(member)
        return freed
