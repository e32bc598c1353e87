"""Elastic data parallelism (Libra's other direction): idle rollout workers join a pooled job's
training at an optimizer-step boundary, and leave at a later one.

A widened job is a one-device job with ``members`` (its home first, then its helpers): its
trainer-lane calls run on all of them as a gang (``Gangs.dispatch``; the worker splits a
forward_backward's rows and all-reduces gradients at optim_step), its generates run where they
ran before. Widening queues a ``restore`` of the scheduler's own ahead of the job's calls, on
every member: from the job's snapshot of its last optim_step, the state its home holds at a
boundary, it gives each helper the adapter and optimizer state and the gang its process group.
The job narrows at the first boundary whose next trainer call is not a forward_backward (a
barrier such as sync_weights, a save) or, with nothing of it queued, while turns wait for
rollout workers: each helper closes its copy and takes turns again (its replica of the job comes
back before its next turn of it). At a boundary every member holds the same state and no
gradient, so no update is lost or applied twice; a member lost before then is a worker loss the
job recovers from its snapshot (and the calls since), as a one-device job does.
"""

from __future__ import annotations

from plexrl.coordinator import residency as rs
from plexrl.coordinator.scheduler.gangs import Gangs
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.recovery import Recovery
from plexrl.coordinator.scheduler.state import TRAINER, ScheduledJob, ScheduledWorker, Tables

TRAINING = frozenset({"forward_backward", "optim_step"})  # the calls a helper stays for


class Elastic:
    """Which jobs may widen and onto which workers, widening them, and narrowing them when due."""

    def __init__(self, t: Tables, pool: Pool, gangs: Gangs, recovery: Recovery) -> None:
        self.t = t
        self.pool = pool
        self.gangs = gangs
        self.recovery = recovery
        self._since: dict[str, float] = {}  # widening job -> when its join started

    def joinable(self, job: ScheduledJob) -> bool:
        """The job may widen now: a recoverable pooled one-device job with its state on its home's
        device, at a step boundary, its next trainer call a forward_backward and none running."""
        home = self.t.registered.get(job.home)
        queue = job.queues[TRAINER]
        return (
            job.pooled
            and job.recoverable
            and job.devices == 1
            and not job.members
            and not job.step_open
            and not job.closing
            and not job.rebuilding
            and job.lost is None
            and job.state.tier == rs.DEVICE
            and job.job_id not in self.t.swapping
            and home is not None
            and bool(queue)
            and not job.running[TRAINER]
            and self.t.calls[queue[0]].kind == "forward_backward"
        )

    def helpers(self, job: ScheduledJob) -> list[ScheduledWorker]:
        """The rollout workers that could join ``job``'s training now: taking turns, none running,
        no transfer in flight, and room for its state once its replica there is gone."""
        found = []
        for w in self.t.rollout():
            if w.running or w.swapping is not None:
                continue
            replica = self.t.replicas.get(w.worker_id, {}).get(job.job_id)
            freed = replica.held_bytes if replica is not None else 0
            if w.used_bytes - freed + job.state.state_bytes <= self.t.room(w, self.t.fixes(w, job)):
                found.append(w)
        return found

    def widen(self, job: ScheduledJob, helpers: list[ScheduledWorker], now: float) -> list[str]:
        """``helpers`` join ``job``'s training behind a restore on every member; returns the members."""
        for w in helpers:
            self.pool.hand_over(w, job)
            w.lent_to = job.job_id
            self.t.roles_changed(w)
            w.jobs.add(job.job_id)
            w.fixed.update(self.t.fixes(w, job))
            w.used_bytes += job.state.state_bytes
        job.members = (job.home, *(w.worker_id for w in helpers))
        self.t.widened.add(job.job_id)
        self._since[job.job_id] = now
        self.recovery.queue_own(job, "restore", now)  # a join's while the job is widened (``Gangs.dispatch``)
        return list(job.members)

    def joined(self, job_id: str, now: float) -> float:
        """The restore of the job's widening ended: how long the join took."""
        return now - self._since.pop(job_id, now)

    def narrows(self, job: ScheduledJob, turns_wait: bool) -> bool:
        """The widened job's helpers are due to leave: it is at a step boundary with nothing of its
        trainer lane running or moving, and its next trainer call is not training (or, with none
        queued, turns wait for rollout workers: ``turns_wait``)."""
        if job.step_open or job.running[TRAINER] or job.job_id in self.t.group_swaps:
            return False
        queue = job.queues[TRAINER]
        if not queue:
            return turns_wait
        return self.t.calls[queue[0]].kind not in TRAINING | {"restore"}
