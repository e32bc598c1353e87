"""The ``Scheduler``: one method per event, each a few named steps over the parts' shared tables."""

from __future__ import annotations

from plexrl.coordinator import residency as rs
from plexrl.coordinator.buckets import Mlfq, Trajectories
from plexrl.coordinator.events import (
    Action,
    CallCancelled,
    CallFinished,
    CallSubmitted,
    EnginesMoved,
    Event,
    GangBroken,
    JobClosed,
    JobOpened,
    JobResumed,
    JobSized,
    Recover,
    ReplicaFailed,
    SwapDone,
    Tick,
    WorkerJoined,
    WorkerLost,
    WorkerRole,
)
from plexrl.coordinator.policies import POLICIES
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.residency import Residency
from plexrl.coordinator.scheduler.calls import Calls
from plexrl.coordinator.scheduler.dispatch import Dispatcher
from plexrl.coordinator.scheduler.elastic import Elastic
from plexrl.coordinator.scheduler.engines import Engines
from plexrl.coordinator.scheduler.gangs import Gangs
from plexrl.coordinator.scheduler.placement import Placement
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.recovery import LOST, Recovery
from plexrl.coordinator.scheduler.state import (
    MAKES_STATE,
    SAMPLER,
    TRAINER,
    JobView,
    ScheduledJob,
    ScheduledWorker,
    Tables,
)
from plexrl.coordinator.scheduler.swaps import Swaps
from plexrl.errors import JobClosedError, WorkerLostError
from plexrl.names import Role

Step = tuple[list[Action], list[str]]  # an event's own actions, and the workers whose dispatch it may change


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
        t = self.t = Tables(POLICIES[policy](), Trajectories(mlfq or Mlfq()), rebalancer, recovery_wait_s)
        self.trajectories, self.rebalancer, self.ledger = t.trajectories, rebalancer, t.ledger
        self.engines = Engines(t)
        self.swaps = Swaps(t)
        self.gangs = Gangs(t, self.swaps)
        self.pool = Pool(t)
        self.placement = Placement(t)
        self.calls = Calls(t, self.pool)
        self.dispatcher = Dispatcher(t, self.engines, self.swaps, self.gangs, self.pool)
        self.recovery = Recovery(t, self.calls, self.dispatcher, self.placement, self.gangs, self.pool)
        self.elastic = Elastic(t, self.pool, self.gangs, self.recovery)

    # -- queries (for the server, status, accounting and the rebalancer) --------------------------

    def queued(self, job_id: str) -> int:
        job = self.t.jobs.get(job_id)
        return sum(len(q) for q in job.queues.values()) if job else 0

    def is_running(self, job_id: str) -> bool:
        job = self.t.jobs.get(job_id)
        return bool(job and any(job.running.values()))

    def has_waiting(self) -> bool:
        """Some job waits for its state to be swapped in, or for a worker, or the rebalancer has
        pooled jobs to watch (a ``Tick`` may now matter)."""
        t = self.t
        return bool(
            t.waiting
            or t.homeless
            or (t.rebalancer is not None and t.pooled)
            or any(w.wanted for w in t.registered.values())
        )

    def queued_turns(self) -> int:
        """Pooled jobs' turns that could start now but wait for a rollout worker's slot."""
        return sum(len(self.t.startable(self.t.jobs[j], SAMPLER)) for j in self.t.pooled)

    def rollout_load(self) -> float:
        """Turns running per rollout worker, on average (0 with none)."""
        rollout = self.t.rollout()
        return sum(len(w.running) for w in rollout) / len(rollout) if rollout else 0.0

    def trainer_busy(self, job_id: str) -> bool:
        """The job has a trainer-lane call queued or running."""
        job = self.t.jobs.get(job_id)
        return bool(job and (job.queues[TRAINER] or job.running[TRAINER]))

    def workers(self) -> list[ScheduledWorker]:
        return self.t.workers()

    def worker(self, worker_id: str) -> ScheduledWorker:
        """The registered worker (KeyError: none by that id)."""
        return self.t.registered[worker_id]

    def joinable(self, job_id: str) -> bool:
        """Rollout workers may join the job's training now (``Elastic.joinable``)."""
        job = self.t.jobs.get(job_id)
        return job is not None and self.elastic.joinable(job)

    def helpers(self, job_id: str) -> list[ScheduledWorker]:
        """The rollout workers that could join the job's training now (``Elastic.helpers``)."""
        return self.elastic.helpers(self.t.jobs[job_id])

    def view(self, job_id: str) -> JobView:
        """The job as the scheduler holds it (KeyError: no such job)."""
        job = self.t.jobs[job_id]
        sampler = job.sampler if job.sampler != job.home else ""
        return JobView(job.home, sampler, job.pooled, job.recoverable, job.closing, job.lost, job.members)

    def where(self, call_id: int) -> str | None:
        """The worker running the call (None: queued, or not known)."""
        return self.t.ran_on.get(call_id)

    def members(self, call_id: int) -> tuple[str, ...]:
        """The workers a gang's running call runs on, its leader first (() : not a gang's)."""
        return self.t.gangs.get(call_id, ("", ()))[1]

    def follows_on(self, call_id: int) -> bool:
        """The call, if it ends well, goes on as a call of the scheduler's own on its job's sampler
        worker: its caller hears once that one is done."""
        return self.recovery.follows_on(call_id)

    def busy_s(self, worker_id: str, now: float) -> float:
        return self.ledger.busy_s(worker_id, now)

    def residency(self, job_id: str) -> Residency | None:
        job = self.t.jobs.get(job_id)
        return job.state if job else None

    def running_on(self, worker_id: str) -> set[str]:
        """The kinds of the calls running on the worker (none for a worker it does not know)."""
        worker = self.t.registered.get(worker_id)
        calls = self.t.calls
        return {calls[c].kind for c in worker.running if c in calls} if worker else set()

    def used_bytes(self, worker_id: str) -> int:
        return self.t.registered[worker_id].used_bytes

    def budget(self, worker_id: str) -> float:
        """The device memory jobs' state may use on the worker now (the plan's room, at most its budget)."""
        return self.t.registered[worker_id].budget

    def bytes_per_s(self, worker_id: str) -> float:
        """The worker's host<->device bandwidth as measured so far (the transfer cost model)."""
        return self.t.registered[worker_id].bytes_per_s

    @property
    def recovery_wait_s(self) -> float:
        """How long a job whose worker was lost waits for another before it is lost."""
        return self.t.recovery_wait_s

    # -- events ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        """The actions ``event`` calls for: its own step's, then whatever the workers it touched
        can start now (dispatch looks only there)."""
        trained = self._trained_jobs(event)
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
                actions, touched = self.recovery.lose_worker(worker_id, reason, now), []
            case GangBroken(job_id, reason):
                actions, touched = self.recovery.rebuild(job_id, reason, now), []
            case JobOpened():
                actions, touched = self._on_job_opened(event, now), []
            case JobResumed():
                actions, touched = self._on_job_resumed(event, now), []
            case JobSized(job_id, state_bytes, snapshots):
                if (sized := self.t.jobs.get(job_id)) is not None:
                    sized.recoverable = snapshots and sized.sampler == sized.home  # colocated jobs only
                actions, touched = [], [w for w in [self.placement.resize(job_id, state_bytes)] if w]
            case JobClosed():
                actions, touched = self._on_job_closed(event, now)
            case SwapDone(job_id, seconds, moved_bytes, ok, worker_id):
                actions, touched = [], self.swaps.done(job_id, worker_id, seconds, moved_bytes, ok)
            case ReplicaFailed(worker_id, job_id):
                # The worker gets the replica again before the job's next turn there; what it holds goes.
                released: list[Action] = [*self.pool.release(worker_id, job_id)]
                actions, touched = (released if job_id in self.t.jobs else []), []
            case EnginesMoved(worker_id, seconds, ok):
                actions, touched = [], [w for w in [self.engines.moved(worker_id, seconds, ok, now)] if w]
            case Tick():
                actions, touched = self._on_tick(now), []
            case CallCancelled():
                actions, touched = [], self._on_call_cancelled(event)
        if self.t.widened or (trained and self.rebalancer is not None):
            elastic, widened = self._elastic(trained, now)
            actions, touched = actions + elastic, touched + widened
        actions += self._dispatch(touched, now)
        if self.t.moving_workers:
            actions += self.pool.moves_due()
        return actions

    def _trained_jobs(self, event: Event) -> list[str]:
        """The pooled jobs whose training ``event`` may bring to a step boundary rollout workers
        could join it at: a trainer call's job (submitted or done), or all on a tick."""
        if isinstance(event, Tick):
            return sorted(self.t.pooled)
        call = self.t.calls.get(event.call_id) if isinstance(event, CallFinished) else None
        job_id = event.job_id if isinstance(event, CallSubmitted) else call.job_id if call is not None else ""
        kind = event.kind if isinstance(event, CallSubmitted) else call.kind if call is not None else "generate"
        return [job_id] if job_id in self.t.pooled and kind != "generate" else []

    def _elastic(self, trained: list[str], now: float) -> Step:
        """Libra's other direction (``scheduler/elastic.py``): widened jobs whose helpers are due
        leave narrow, then idle rollout workers join the training of ``trained`` where it pays."""
        actions: list[Action] = []
        touched: list[str] = []
        turns_wait: bool | None = None
        for job_id in sorted(self.t.widened):
            job = self.t.jobs[job_id]
            if turns_wait is None and not job.queues[TRAINER]:
                turns_wait = self.queued_turns() > 0
            if self.elastic.narrows(job, bool(turns_wait)):
                released, members = self.gangs.narrow(job)
                actions += released
                touched += members
        if self.rebalancer is not None and trained:
            for job_id, helpers in self.rebalancer.joins(self, trained, now):
                touched += self.elastic.widen(self.t.jobs[job_id], helpers, now)
        return actions, touched

    def _on_call_submitted(self, event: CallSubmitted, now: float) -> Step:
        job_id, kind, trajectory = event.job_id, event.kind, event.trajectory
        level = self.trajectories.turn(job_id, trajectory, event.signals) if trajectory and kind == "generate" else 0
        call = self.calls.new(event.call_id, job_id, kind, event.priority, event.front, trajectory, level)
        actions = self.calls.submit(call, now)
        job = self.t.jobs[job_id]
        if not actions and self.rebalancer is not None and job.pooled and call.lane == TRAINER:
            if call.kind == "forward_backward":
                self.rebalancer.training_started(job.job_id, now)
            home = self.t.registered.get(job.home)
            if home is not None and home.role == "rollout" and not home.moving_to:  # training is on the critical path
                actions = self._move_worker(home, "train", now)
        return actions, self.calls.lane_workers(call)

    def _on_call_finished(self, event: CallFinished, now: float) -> Step:
        call_id, error = event.call_id, event.error
        done = self.t.calls.get(call_id)
        ran = self.t.ran_on.get(call_id)
        touched = [ran] if ran else self.calls.lane_workers(done) if done is not None else []
        touched = list(self.t.gangs[call_id][1]) if call_id in self.t.gangs else touched
        started = self.t.started.pop(call_id, None)
        if done is not None and done.trajectory and ran and started is not None:
            self.trajectories.ran(done.job_id, done.trajectory, ran, now - started)
        follows = not error and self.recovery.follows_on(call_id)
        own = self.t.own.get(call_id)
        self.calls.finish(call_id, now)
        if done is None:
            return [], touched
        if follows:
            self.recovery.follow_on(done, now)
        job = self.t.jobs.get(done.job_id)
        actions: list[Action] = []
        joined = job is not None and job.elastic and own is not None and own.kind == "restore"
        seconds = self.elastic.joined(done.job_id, now) if joined else 0.0
        if joined and not error:  # its helpers hold its state now
            if self.rebalancer is not None:
                self.rebalancer.joined(seconds)
        elif job is not None:  # (a join's restore that failed left its state nowhere: as a recovery's)
            actions += self._ended(job, done.kind, error, now)
        # A barrier's end (or any call's, before a barrier) may free the other lane too.
        others = [w for w in self.calls.other_workers(done) if w not in touched]
        return actions + self._dispatch(others, now), touched

    def _ended(self, job: ScheduledJob, kind: str, error: str | None, now: float) -> list[Action]:
        """What a call of ``kind`` ending (``error``: badly) changes for its job."""
        if not error:
            job.opened |= kind in MAKES_STATE
            job.weights_epoch += kind in ("sync_weights", "load", "restore")
            # Gradients wait on its workers from a forward_backward to its optim_step (a restore
            # replays the forward_backwards since its snapshot: it leaves the step as it was).
            if kind in ("forward_backward", "optim_step", "open"):
                job.step_open = kind == "forward_backward"
            if job.pooled and self.rebalancer is not None and kind in ("open", "restore", "sync_weights"):
                self.rebalancer.rollout_started(job.job_id, now)
            return []
        if kind == "open":  # nothing of the job exists: its other calls fail
            return self.recovery.lose_job(job, JobClosedError(f"job {job.job_id} did not open: {error}"), now)
        if kind == "restore":
            reason = f"job {job.job_id} could not be restored on another worker ({error}); " + LOST
            return self.recovery.lose_job(job, WorkerLostError(reason), now)
        return []

    def _on_worker_joined(self, joined: WorkerJoined, now: float) -> Step:
        worker = ScheduledWorker(joined.worker_id, max(1, joined.slots), joined.memory_bytes, joined.swap_bytes_per_s,
                                 role=joined.role, bucket=joined.bucket, node=joined.node, index=joined.index,
                                 stateless_generates=joined.stateless_generates, devices=max(1, joined.devices),
                                 plan=joined.plan, background_calls=frozenset(joined.background_calls))  # fmt: skip
        worker.trainer_slots = joined.trainer_slots if joined.trainer_slots > 0 else worker.slots
        self.t.registered[worker.worker_id] = worker
        self.t.roles_changed(worker)
        # The first rollout worker (or a new bucket) takes turns queued on homes (or elsewhere).
        touched = sorted(self.t.registered) if worker.role == "rollout" else [worker.worker_id]
        return self.recovery.rehome_waiting(now), touched

    def _on_worker_role(self, event: WorkerRole, now: float) -> Step:
        moved = self.t.registered.get(event.worker_id)
        if moved is None:
            return [], []
        if event.seconds > 0 and self.rebalancer is not None:
            self.rebalancer.moved(event.seconds)
        if event.role == moved.role and not moved.moving_to:
            return [], []
        moved.role, moved.moving_to, moved.move_sent = event.role, "", False  # the move is over (or overridden)
        self.t.moving_workers.discard(moved.worker_id)
        self.t.roles_changed(moved)  # its running calls finish where they are
        actions = self.recovery.rehome_waiting(now) if event.role != "rollout" else []
        return actions, sorted(self.t.registered)  # queued turns re-route

    def _on_job_opened(self, event: JobOpened, now: float) -> list[Action]:
        job_id, pooled = event.job_id, event.pooled
        if event.devices != 1:
            elsewhere = event.disaggregated or pooled
            return self.gangs.place(
                job_id, event.state_bytes, event.weight, event.base, event.devices, elsewhere, now, event.shape
            )
        actions = self.placement.place(
            job_id, event.state_bytes, event.weight, event.base, event.disaggregated, now, event.shape
        )
        if pooled and job_id in self.t.jobs:
            self.t.jobs[job_id].pooled = True
            self.t.pooled.add(job_id)
        return actions

    def _on_job_resumed(self, event: JobResumed, now: float) -> list[Action]:
        job_id = event.job_id
        job = ScheduledJob(job_id, "", Residency(event.state_bytes, rs.HOST), weight=event.weight, base=event.base)
        job.recoverable = job.rebuilding = True
        self.t.jobs[job_id] = job
        self.ledger.job_opened(job_id, now)
        self.t.homeless[job_id] = (now, f"job {job_id} was resumed from the journal of a restarted coordinator")
        actions = self.recovery.rehome(job, now)
        if not actions:
            return [Recover(job_id, "", restore=False)]
        return actions + self._dispatch([job.home], now)  # its restore starts

    def _on_job_closed(self, event: JobClosed, now: float) -> Step:
        job_id, t = event.job_id, self.t
        actions: list[Action] = []
        touched: list[str] = []
        job = t.jobs.get(job_id)
        if job is not None and job.unfinished:  # nothing is left to run them on
            actions += self.recovery.lose_job(job, JobClosedError(f"job {job_id} was closed before the call ran"), now)
        t.homeless.pop(job_id, None)
        t.pooled.discard(job_id)
        self.trajectories.forget(job_id)
        if self.rebalancer is not None:
            self.rebalancer.forget(job_id)
        self.ledger.job_closed(job_id, now)
        t.waiting.discard(job_id)
        job = t.jobs.pop(job_id, None)
        if job is not None:
            actions += self.pool.releases(job)
            touched = self.gangs.disband(job, now) if job.members else self._forget(job)
        if t.homeless:  # a worker it held may take a waiting job now (dedicated)
            actions += self.recovery.rehome_waiting(now)
        return actions, touched

    def _forget(self, job: ScheduledJob) -> list[str]:
        """Take a closed one-device job off its workers; its home (to dispatch), if registered."""
        if job.sampler in self.t.registered:
            self.t.registered[job.sampler].samplers.discard(job.job_id)
        home = self.t.registered.get(job.home)
        if home is None:
            return []
        self.placement.unhome(home, job)
        if job.state.tier == rs.DEVICE:  # state in transit is settled by its SwapDone
            home.used_bytes -= job.state.state_bytes
        return [job.home]

    def _on_tick(self, now: float) -> list[Action]:
        """Waiting jobs may hit their starvation bound (or homeless ones their recovery wait), an
        engines' switch may be due, and the rebalancer may move a worker."""
        actions = self.recovery.give_up(now)
        homes = {self.t.jobs[j].home for j in self.t.waiting if j in self.t.jobs}
        homes |= {w.worker_id for w in self.t.registered.values() if w.wanted}
        actions += self._dispatch(sorted(homes), now)
        if self.rebalancer is not None and self.t.pooled:
            for worker_id, role in self.rebalancer.plan(self, now):
                actions += self._move_worker(self.t.registered[worker_id], role, now)
        return actions

    def _on_call_cancelled(self, event: CallCancelled) -> list[str]:
        group = self.calls.cancel(event.call_id)
        if group is not None and group.members:  # its claim on the members may have no call left
            return self.gangs.unclaim(group)
        return []

    def _move_worker(self, worker: ScheduledWorker, role: Role, now: float) -> list[Action]:
        """Start moving ``worker`` to ``role`` (``Pool.start_move``); turns that waited for it go to
        the other rollout workers."""
        self.pool.start_move(worker, role)
        return self._dispatch([w.worker_id for w in self.t.rollout()], now)

    def _dispatch(self, worker_ids: list[str], now: float) -> list[Action]:
        """Dispatch on each of the registered workers among ``worker_ids``, in that order."""
        actions: list[Action] = []
        for worker_id in worker_ids:
            if worker_id in self.t.registered:
                actions += self.dispatcher.dispatch(self.t.registered[worker_id], now)
        return actions
