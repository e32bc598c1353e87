"""Recovery and the scheduler's own calls: lost workers, re-homed jobs, restores, lost jobs, follow-ons."""

from __future__ import annotations

from dataclasses import replace

from plexrl.coordinator import residency as rs
from plexrl.coordinator.events import Action, Fail, JobLost, OwnCall, Recover
from plexrl.coordinator.residency import Residency
from plexrl.coordinator.scheduler.calls import Calls
from plexrl.coordinator.scheduler.dispatch import Dispatcher
from plexrl.coordinator.scheduler.gangs import Gangs
from plexrl.coordinator.scheduler.placement import Placement
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.state import (
    FOLLOW_ON,
    MAKES_STATE,
    SAMPLER,
    TRAINER,
    ScheduledCall,
    ScheduledJob,
    Tables,
)
from plexrl.errors import GangBrokenError, NoWorkersError, PlexError, WorkerLostError
from plexrl.names import CallKind

LOST = "its unsaved training state is gone: open the job again and load its last checkpoint"


class Recovery:
    """A recoverable job whose worker is lost is re-homed behind a ``restore`` of the scheduler's
    own; any other job on it is lost (every call of it fails). The scheduler's own calls
    (``OwnCall``: negative ids) are queued here: restores, and a disaggregated job's follow-ons."""

    def __init__(
        self, t: Tables, calls: Calls, dispatcher: Dispatcher, placement: Placement, gangs: Gangs, pool: Pool
    ) -> None:
        self.t = t
        self.calls = calls
        self.dispatcher = dispatcher
        self.placement = placement
        self.gangs = gangs
        self.pool = pool

    def lose_worker(self, worker_id: str, reason: str, now: float) -> list[Action]:
        """The worker is gone: its pooled turns go back to their queues, each job it homed is
        recovered or lost, and what waited for it starts elsewhere."""
        worker = self.t.registered.pop(worker_id, None)
        if worker is None:
            return []
        self.t.rollout_ids.discard(worker_id)
        self.t.moving_workers.discard(worker_id)
        self.t.replicas.pop(worker_id, None)
        if worker.swapping is not None:
            self.t.swapping.pop(worker.swapping.job_id, None)
        actions: list[Action] = []
        survivors: set[str] = set()  # other members of its groups: their slots and memory are free now
        for call_id in sorted(worker.running):
            call = self.t.calls.get(call_id)
            job = self.t.jobs.get(call.job_id) if call is not None else None
            if call is None or job is None or not job.pooled or call.lane != SAMPLER or job.home == worker_id:
                continue
            job.running[SAMPLER].discard(call_id)
            self.t.free(call_id, job.job_id, now)
            self.t.enqueue(job, call)  # a pooled turn that ran there goes back to its queue
        for job_id in sorted(worker.jobs | worker.samplers):
            job = self.t.jobs[job_id]
            if job.lost is not None:
                continue  # lost already (its restore failed): nothing of it to recover
            lost = f"worker {worker_id} holding job {job_id}'s state was lost ({reason})"
            opening = any(self.t.calls[c].kind == "open" for c in job.unfinished)  # no state exists yet
            if job.elastic and job.home != worker_id and job.home in self.t.registered:
                actions += self.rebuild_at_home(job, now)  # a worker helping it train
                survivors.add(job.home)
                continue
            if job.members:  # a group lives or dies as a unit: its other shards are of no use alone
                survivors.update(self.gangs.disband(job, now, requeue=job.recoverable or opening))
                job.home = job.sampler = worker_id
            if (job.recoverable or opening) and job.sampler == job.home == worker_id:
                actions += self._recover(job, worker_id, lost, now)
            else:
                actions += self.lose_job(job, WorkerLostError(f"{lost}; {LOST}"), now)
        homes = {a.worker_id for a in actions if isinstance(a, Recover) and a.worker_id} | survivors
        for job_id in sorted(self.t.pooled):  # queued turns go to the rollout workers left (or their homes)
            queued = self.t.jobs[job_id].queues[SAMPLER]
            homes |= {w for c in queued for w in self.calls.lane_workers(self.t.calls[c])}
        # A re-queued restore starts there (a new one is submitted and starts then).
        return actions + self._dispatch(homes, now)

    def rebuild(self, job_id: str, reason: str, now: float) -> list[Action]:
        """A gang job whose process group broke mid-call: its members may hold different states,
        so it is taken off them and recovered (on a block, maybe the same one, behind a restore
        from its snapshot; its running call queued again), or lost, as if a member were lost."""
        job = self.t.jobs.get(job_id)
        if job is None or not job.members or job.lost is not None:
            return []
        leader = job.home
        broke = f"job {job_id}'s gang broke ({reason})"
        if job.elastic:  # its home holds it still: rebuilt there
            return self.rebuild_at_home(job, now) + self._dispatch({leader}, now)
        survivors = self.gangs.disband(job, now, requeue=job.recoverable)
        job.home = job.sampler = leader
        if job.recoverable:
            actions = self._recover(job, leader, broke, now)
        else:
            actions = self.lose_job(job, GangBrokenError(f"{broke}; {LOST}"), now)
        homes = {a.worker_id for a in actions if isinstance(a, Recover) and a.worker_id} | set(survivors)
        return actions + self._dispatch(homes, now)

    def rebuild_at_home(self, job: ScheduledJob, now: float) -> list[Action]:
        """A job rollout workers helped train (``Elastic``) lost one, or its gang broke: the
        helpers leave, its calls running on them go back to its queue, and a restore from its
        snapshot and the calls since, on its home, rebuilds the state of its last finished call
        (the step's gradients were on every member)."""
        for call_id in sorted(job.running[TRAINER]):
            self.t.free(call_id, job.job_id, now)
            job.running[TRAINER].discard(call_id)
            self.t.enqueue(job, self.t.calls[call_id])
        released, _ = self.gangs.narrow(job)
        job.rebuilding = True
        restore = self._restores(job, now)
        self.t.homeless.pop(job.job_id, None)
        return [*released, Recover(job.job_id, job.home, restore=restore)]

    def _recover(self, job: ScheduledJob, lost_worker: str, lost: str, now: float) -> list[Action]:
        """A job whose worker was lost lives on: its running calls are queued again, behind a
        ``restore`` (the one already pending, if any) on a new home, or behind its own ``open``
        if it never finished opening (nothing of it existed: opening it there is all it takes)."""
        for lane in (SAMPLER, TRAINER):
            for call_id in sorted(job.running[lane]):
                if self.t.ran_on.get(call_id, lost_worker) != lost_worker:
                    continue  # a pooled turn on a rollout worker runs on
                self.t.enqueue(job, self.t.calls[call_id])
                self.t.free(call_id, job.job_id, now)
                job.running[lane].discard(call_id)
        self.t.waiting.discard(job.job_id)
        job.home = job.sampler = ""
        job.state = Residency(job.state.state_bytes, rs.HOST)  # made on the device by its restore (or open)
        job.rebuilding = "open" not in {self.t.calls[c].kind for c in job.unfinished}
        self.t.homeless[job.job_id] = (now, lost)
        actions = self.rehome(job, now)
        return actions or [Recover(job.job_id, "", restore=False)]  # it waits for a worker

    def rehome_waiting(self, now: float) -> list[Action]:
        """Place the jobs waiting for a worker where one can take them now (a worker joined, or a
        job closed and freed one), and start their calls there."""
        actions: list[Action] = []
        for job_id in sorted(self.t.homeless):
            actions += self.rehome(self.t.jobs[job_id], now)
        return actions + self._dispatch({a.worker_id for a in actions if isinstance(a, Recover) and a.worker_id}, now)

    def rehome(self, job: ScheduledJob, now: float) -> list[Action]:
        """Place a job that lost its worker (or never had one), if a worker can take it now."""
        if job.devices > 1:
            block = self.gangs.choose(job, job.devices)
            if isinstance(block, NoWorkersError):
                return []
            del self.t.homeless[job.job_id]
            self.gangs.seat(job, block)  # its state is in host memory (or nowhere): made on the block by its restore
            return [Recover(job.job_id, job.home, restore=self._restores(job, now), members=job.members)]
        chosen = self.placement.choose(job, False, now)
        if isinstance(chosen, NoWorkersError):
            return []
        del self.t.homeless[job.job_id]
        # A pooled job's replica there (a worker lent to rollout, and back) goes: its home now.
        released = self.pool.release(chosen.worker_id, job.job_id)
        self.placement.home(chosen, job)
        job.sampler = chosen.worker_id
        return [*released, Recover(job.job_id, chosen.worker_id, restore=self._restores(job, now))]

    def give_up(self, now: float) -> list[Action]:
        """Lose each job that has waited for a worker longer than the recovery wait."""
        actions: list[Action] = []
        for job_id, (since, why) in sorted(self.t.homeless.items()):
            if now - since >= self.t.recovery_wait_s:
                del self.t.homeless[job_id]
                job = self.t.jobs[job_id]
                opening = any(self.t.calls[c].kind == "open" for c in job.unfinished)
                gave_up = (NoWorkersError if opening else WorkerLostError)(
                    f"{why}, and no worker could take it over within {self.t.recovery_wait_s:g} s"
                )
                actions += self.lose_job(job, gave_up, now)
        return actions

    def lose_job(self, job: ScheduledJob, error: PlexError, now: float) -> list[Action]:
        """The job cannot go on: fail its calls (and every later one) with ``error``; the slots
        its running calls held on surviving workers may start other jobs' calls."""
        job.lost = error
        self.t.homeless.pop(job.job_id, None)
        actions: list[Action] = []
        if job.elastic:  # the rollout workers helping train it take turns again
            actions += self.gangs.narrow(job)[0]
        for call_id in sorted(job.unfinished):
            self.t.calls.pop(call_id, None)
            self.t.own.pop(call_id, None)
            actions.append(Fail(job.job_id, call_id, error))
        freed: set[str] = set()
        for lane in (SAMPLER, TRAINER):
            for call_id in job.running[lane]:
                freed.update(self.t.free(call_id, job.job_id, now))
            job.queues[lane].clear()
            job.running[lane].clear()
        job.unfinished.clear()
        job.barriers.clear()
        self.t.waiting.discard(job.job_id)
        actions.append(JobLost(job.job_id, error))
        return actions + self._dispatch(freed, now)

    # -- the scheduler's own calls

    def follows_on(self, call_id: int) -> bool:
        """The call, if it ends well, goes on as a call of the scheduler's own on its job's sampler
        worker (``follow_on``): its caller hears once that one is done."""
        call = self.t.calls.get(call_id)
        job = self.t.jobs.get(call.job_id) if call is not None else None
        if call is None or job is None or call_id in self.t.own or call.kind not in FOLLOW_ON:
            return False
        return job.sampler != job.home and not job.members and job.sampler in self.t.registered

    def follow_on(self, done: ScheduledCall, now: float) -> None:
        """A disaggregated job's barrier ended well on its home: its sampler worker does its part next,
        in the barrier's place (nothing of the job passes it)."""
        self.queue_own(self.t.jobs[done.job_id], FOLLOW_ON[done.kind], now, after=done)

    def _restores(self, job: ScheduledJob, now: float) -> bool:
        """Queue a ``restore`` ahead of the re-homed job's calls, unless one is pending or it never
        opened (its ``open`` makes it): whether it did."""
        if {self.t.calls[c].kind for c in job.unfinished} & MAKES_STATE:
            return False
        self.queue_own(job, "restore", now)
        return True

    def queue_own(self, job: ScheduledJob, kind: CallKind, now: float, after: ScheduledCall | None = None) -> None:
        """Submit a call of the scheduler's own for ``job``: ahead of its other calls, or in the place
        of the call ``after`` (just done) on its sampler worker."""
        assert job.lost is None, f"no call of its own for lost job {job.job_id}"
        call_id = next(self.t.own_ids)
        self.t.own[call_id] = OwnCall(job.job_id, kind, follows=after.call_id if after is not None else 0)
        call = self.calls.new(call_id, job.job_id, kind, front=after is None)
        if after is not None:
            call = replace(call, seq=after.seq, lane=SAMPLER)
        self.calls.submit(call, now)

    def _dispatch(self, worker_ids: set[str], now: float) -> list[Action]:
        actions: list[Action] = []
        for worker_id in sorted(worker_ids & self.t.registered.keys()):
            actions += self.dispatcher.dispatch(self.t.registered[worker_id], now)
        return actions
