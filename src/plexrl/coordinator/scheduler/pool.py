"""The rollout pool: where pooled jobs' turns run, the replicas they need, and workers' role moves."""

from __future__ import annotations

from plexrl.coordinator.buckets import bucket_for
from plexrl.coordinator.events import Action, MoveWorker, Release, Replicate
from plexrl.coordinator.scheduler.state import SAMPLER, ScheduledCall, ScheduledJob, ScheduledWorker, Tables
from plexrl.names import Role
from plexrl.plan import served_bytes

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

    def replicate(self, worker: ScheduledWorker, job: ScheduledJob, call: ScheduledCall) -> list[Action]:
        """What ``worker`` needs before it runs a pooled job's turn: a replica of the job's sampler,
        and its current weights (``Replicate``), unless it has them."""
        if not job.pooled or call.lane != SAMPLER or worker.worker_id == job.home:
            return []
        held = self.t.replicas.setdefault(worker.worker_id, {})
        new = job.job_id not in held
        stale = held.get(job.job_id, 0) != job.weights_epoch
        if not new and not stale:
            return []
        held[job.job_id] = job.weights_epoch
        weight_bytes = self._weight_bytes(worker, job)
        return [Replicate(worker.worker_id, job.job_id, open=new, weights=stale, weight_bytes=weight_bytes)]

    @staticmethod
    def _weight_bytes(worker: ScheduledWorker, job: ScheduledJob) -> int:
        """What the job's served weights weigh on ``worker``: its trained parameters in the device's
        dtype (by the plan; else estimated from its state, as an AdamW job's in bf16)."""
        if worker.plan is not None and job.shape is not None:
            return job.shape.trained_params * worker.plan.dtype_bytes
        return served_bytes(job.state.state_bytes)

    def release(self, worker_id: str, job_id: str) -> list[Release]:
        """Drop the job's replica on the worker, if it holds one: ``Release`` it there."""
        if self.t.replicas.get(worker_id, {}).pop(job_id, None) is None:
            return []
        return [Release(worker_id, job_id)]

    def releases(self, job: ScheduledJob) -> list[Release]:
        """What workers hold of a job being forgotten: its replicas on rollout workers, and if it was
        lost after it opened, what its surviving workers hold (a closed job's close freed that)."""
        held = sorted(w for w, replicas in self.t.replicas.items() if replicas.pop(job.job_id, None) is not None)
        if job.lost is not None and job.opened:
            held += sorted({job.home, job.sampler} & self.t.registered.keys())
        return [Release(w, job.job_id) for w in held]

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
