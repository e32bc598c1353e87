"""The rollout pool: where pooled jobs' turns run, the replicas they need, and workers' role moves."""

from __future__ import annotations

from collections.abc import Callable

from plexrl.coordinator.buckets import bucket_for
from plexrl.coordinator.events import Action, MoveWorker, Release, Replicate
from plexrl.coordinator.scheduler.state import SAMPLER, Replica, ScheduledCall, ScheduledJob, ScheduledWorker, Tables
from plexrl.errors import JobTooLargeError
from plexrl.names import Role
from plexrl.plan import gib, served_bytes

STICKY_SLACK = 4  # a trajectory's turn goes back to its last worker unless that runs this many more turns than another


class Pool:
    """Each turn goes to the bucket of its trajectory's level (``buckets.py``), to the worker its
    trajectory's last turn ran on if that one has a free slot (its prefix cache); a rollout worker
    gets a replica of a job's sampler, and each new version of its weights, just ahead of a turn."""

    def __init__(self, t: Tables) -> None:
        self.t = t

    # -- routing

    def route(self, job: ScheduledJob, call: ScheduledCall) -> list[str]:
        """The rollout workers a pooled job's turn may run on, in the order to try them: those of
        its bucket (its trajectory's last one first, if it sticks), then of the buckets below."""
        rollout = self.t.rollout()
        bucket = bucket_for(call.level, sorted({w.bucket for w in rollout}))
        traj = self.t.trajectories.get(job.job_id, call.trajectory) if call.trajectory else None
        last = traj.worker if traj is not None else ""
        # The least loaded first (each running turn slows a worker's decode steps), its last
        # worker ahead of them if it sticks; then the buckets below, for when this one is full.
        same = sorted((w for w in rollout if w.bucket == bucket), key=lambda w: (len(w.running), w.worker_id))
        below = sorted((w for w in rollout if w.bucket < bucket), key=lambda w: (-w.bucket, len(w.running)))
        ids = [w.worker_id for w in same]
        least = len(same[0].running) if same else 0
        if last in ids and self._sticks(self.t.registered[last], bucket, least):
            ids.remove(last)
            ids.insert(0, last)
        return ids + [w.worker_id for w in below]

    def turns(self, worker: ScheduledWorker) -> list[tuple[ScheduledJob, list[ScheduledCall]]]:
        """Each pooled job's turns ``worker`` may start now (none unless it takes turns)."""
        if not (self.t.takes_turns(worker) and self.t.pooled):
            return []
        buckets: dict[int, bool] = {}  # each bucket (ascending): whether a worker of it has a free slot
        for w in sorted(self.t.rollout(), key=lambda w: w.bucket):
            buckets[w.bucket] = buckets.get(w.bucket, False) or len(w.running) < w.slots
        entries = []
        for job_id in self.t.pooled:
            job = self.t.jobs[job_id]
            turns = [c for c in self.t.startable(job, SAMPLER) if self._takes_turn(worker, buckets, job, c)]
            if turns:
                entries.append((job, turns))
        return entries

    def _takes_turn(
        self, worker: ScheduledWorker, buckets: dict[int, bool], job: ScheduledJob, call: ScheduledCall
    ) -> bool:
        """The rollout ``worker`` may start this turn of a pooled job: it is in the bucket serving the
        turn's level, or in a lower one while every worker of that bucket is full (``buckets``: each
        bucket, whether one of its workers has a free slot); and the turn's trajectory's last
        worker, if another, does not take it back (``_sticks``)."""
        preferred = bucket_for(call.level, list(buckets))
        if worker.bucket > preferred or (worker.bucket < preferred and buckets[preferred]):
            return False
        traj = self.t.trajectories.get(job.job_id, call.trajectory) if call.trajectory else None
        if traj is None or traj.worker in ("", worker.worker_id):
            return True
        return not self._sticks(self.t.registered.get(traj.worker), worker.bucket, len(worker.running))

    @staticmethod
    def _sticks(last: ScheduledWorker | None, bucket: int, least: int) -> bool:
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

    # -- replicas

    def replicate(
        self, worker: ScheduledWorker, job: ScheduledJob, call: ScheduledCall, now: float
    ) -> tuple[list[Action], bool]:
        """What ``worker`` needs before it runs a pooled job's turn: a replica of the job's sampler,
        and its current weights (``Replicate``), unless it has them; room for a new replica is made
        by releasing the least recently used idle ones. False: no room for it now (the turn waits,
        or goes to another worker)."""
        if not job.pooled or call.lane != SAMPLER or worker.worker_id == job.home:
            return [], True
        held = self.t.replicas.setdefault(worker.worker_id, {})
        replica = held.get(job.job_id)
        actions: list[Action] = []
        if replica is None:
            size = self._weight_bytes(worker, job)
            actions += self.make_room(
                worker, lambda: worker.used_bytes + size <= self.t.room(worker, self.t.fixes(worker, job))
            )
            adds = self.t.fixes(worker, job)
            if worker.used_bytes + size > self.t.room(worker, adds):
                return actions, False
            worker.fixed.update(adds)
            worker.used_bytes += size
            replica = held[job.job_id] = Replica(0, size, now)
            new = True
        else:
            new = False
        stale = replica.epoch != job.weights_epoch
        replica.last_s = now
        if new or stale:
            replica.epoch = job.weights_epoch
            actions.append(Replicate(worker.worker_id, job.job_id, new, stale, replica.held_bytes))
        return actions, True

    def make_room(self, worker: ScheduledWorker, fits: Callable[[], bool]) -> list[Action]:
        """Release ``worker``'s idle replicas (no turn of theirs running there), the least recently
        used first, until what needs the room ``fits()`` (a new replica, or a job's state at home)."""
        calls = self.t.calls
        busy = {calls[c].job_id for c in worker.running if c in calls}
        held = self.t.replicas.get(worker.worker_id, {})
        idle = sorted((r.last_s, j) for j, r in held.items() if j not in busy)
        actions: list[Action] = []
        for _, job_id in idle:
            if fits():
                break
            actions += self.release(worker.worker_id, job_id)
        return actions

    def fits_nowhere(self, job: ScheduledJob) -> JobTooLargeError | None:
        """Why no rollout worker could hold ``job``'s replica even with nothing else on it (None: one could)."""
        sizes = {w.worker_id: self._weight_bytes(w, job) for w in self.t.rollout()}
        if any(sizes[w.worker_id] <= self.t.room_alone(w, job) for w in self.t.rollout()):
            return None
        return JobTooLargeError(
            f"job {job.job_id}'s sampler replica ({gib(max(sizes.values(), default=0))} with its base) fits no "
            "rollout worker even alone: open the job without pooled=True, or start rollout workers with more memory"
        )

    @staticmethod
    def _weight_bytes(worker: ScheduledWorker, job: ScheduledJob) -> int:
        """What the job's served weights weigh on ``worker``: its trained parameters in the device's
        dtype (by the plan; else estimated from its state, as an AdamW job's in bf16)."""
        if worker.plan is not None and job.shape is not None:
            return job.shape.trained_params * worker.plan.dtype_bytes
        return served_bytes(job.state.state_bytes)

    def release(self, worker_id: str, job_id: str) -> list[Release]:
        """Drop the job's replica on the worker, if it holds one: its bytes are free there, and
        ``Release`` frees them on the worker."""
        return self._drop(worker_id, job_id, self.t.jobs.get(job_id))

    def hand_over(self, worker: ScheduledWorker, job: ScheduledJob) -> None:
        """``worker`` joins ``job``'s training: its replica of the job is forgotten here with no
        ``Release`` (the restore that follows replaces it there)."""
        replica = self.t.replicas.get(worker.worker_id, {}).pop(job.job_id, None)
        if replica is not None:
            worker.used_bytes -= replica.held_bytes

    def releases(self, job: ScheduledJob) -> list[Release]:
        """What workers hold of a job being forgotten (``job`` is out of the tables already): its
        replicas on rollout workers, and if it was lost after it opened, what its surviving workers
        hold (a closed job's close freed that)."""
        released = [r for worker_id in sorted(self.t.replicas) for r in self._drop(worker_id, job.job_id, job)]
        if job.lost is not None and job.opened:
            released += [Release(w, job.job_id) for w in sorted({job.home, job.sampler} & self.t.registered.keys())]
        return released

    def _drop(self, worker_id: str, job_id: str, job: ScheduledJob | None) -> list[Release]:
        replica = self.t.replicas.get(worker_id, {}).pop(job_id, None)
        if replica is None:
            return []
        worker = self.t.registered.get(worker_id)
        if worker is not None:
            worker.used_bytes -= replica.held_bytes
            if job is not None:
                self.t.unfix(worker, job)
        return [Release(worker_id, job_id)]

    # -- role moves

    def start_move(self, worker: ScheduledWorker, role: Role) -> None:
        """Start moving ``worker`` to ``role``: from now on it takes no turns (and, bound for
        rollout, no new homes). It switches once drained (``moves_due``)."""
        worker.moving_to = role
        self.t.moving_workers.add(worker.worker_id)
        self.t.roles_changed(worker)

    def moves_due(self) -> list[Action]:
        """``MoveWorker`` for each moving worker that has drained: one bound for rollout at once (its
        homes' trainer calls run on there), one bound for training once no turn runs on it."""
        actions: list[Action] = []
        for worker_id in sorted(self.t.moving_workers):
            worker = self.t.registered.get(worker_id)
            if worker is None or worker.move_sent:
                continue
            calls = self.t.calls
            turns = any(calls[c].kind == "generate" for c in worker.running if c in calls)
            if worker.moving_to == "rollout" or not turns:
                worker.move_sent = True
                actions.append(MoveWorker(worker_id, worker.moving_to or worker.role))
        return actions

    def turns_left_on(self, worker: ScheduledWorker) -> bool:
        """Whether a worker taken back for training still runs turns from its time in rollout."""
        if "train" not in (worker.role, worker.moving_to):
            return False
        return any(c in self.t.calls and self.t.calls[c].lane == SAMPLER for c in worker.running)
