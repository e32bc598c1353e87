"""Dispatch: what a worker starts now, and the swaps (or engine switches) for what cannot start yet."""

from __future__ import annotations

from plexrl.coordinator import residency as rs
from plexrl.coordinator.events import Action, Dispatch, Fail
from plexrl.coordinator.scheduler.engines import EngineGate, Engines, Entries
from plexrl.coordinator.scheduler.gangs import Gangs
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.state import (
    MAKES_STATE,
    SAMPLER,
    TRAINER,
    ScheduledCall,
    ScheduledJob,
    ScheduledWorker,
    Tables,
)
from plexrl.coordinator.scheduler.swaps import Swaps


class Dispatcher:
    """One pass over a worker: its jobs' startable calls in the policy's order, each started while
    a slot, the job's state and the worker's engines allow."""

    def __init__(self, t: Tables, engines: Engines, swaps: Swaps, gangs: Gangs, pool: Pool) -> None:
        self.t = t
        self.engines = engines
        self.swaps = swaps
        self.gangs = gangs
        self.pool = pool

    def dispatch(self, worker: ScheduledWorker, now: float) -> list[Action]:
        """Start what ``worker`` can start, and swap state in or out (or switch its engines) for
        what cannot start yet."""
        actions: list[Action] = []
        if worker.used_bytes > worker.budget and worker.swapping is None:  # a job outgrew the budget (or a base came)
            victim = self.swaps.victim(worker, None, now)
            if victim is not None:
                actions += self.swaps.evict(worker, victim)
        entries = self._entries(worker, now)
        gate = self.engines.gate(worker, entries, now)
        for job, startable in entries:
            if job.members and (not job.elastic or startable[0].lane == TRAINER):
                actions += self.gangs.dispatch(job, startable, now)
            elif not worker.gang:  # a group claiming the worker runs its call here, or waits for it to drain
                actions += self._dispatch_job(worker, job, startable, gate, now)
        return actions + self.engines.switch_due(worker, gate, now)

    def _dispatch_job(
        self, worker: ScheduledWorker, job: ScheduledJob, startable: list[ScheduledCall], gate: EngineGate, now: float
    ) -> list[Action]:
        """Start a one-device job's calls on ``worker``, or bring its state in for them. Lanes on the
        job's home need its state on the device (closing frees it wherever it is); a disaggregated
        job's sampler lane runs on the replica of its sampler worker."""
        first = startable[0]
        if job.rebuilding and first.kind != "restore":
            return []  # its state exists nowhere until the restore (submitted next) makes it
        needs_state = self.t.needs_state(job, first.lane, worker)
        actions: list[Action] = []
        if needs_state and job.state.tier == rs.HOST and self.t.replicas.get(worker.worker_id):
            # Replicas of pooled jobs left here (a worker lent to rollout) give way to a home's state.
            actions += self.pool.make_room(worker, lambda: self.swaps.room(worker, job.state.state_bytes))
        room = self.swaps.room(worker, job.state.state_bytes)
        if needs_state and first.kind in MAKES_STATE and job.state.tier == rs.HOST and room:
            # Its state does not exist yet: the open makes it on the device, so it needs room
            # there, not a transfer (a swap in would reach a worker that has nothing to swap).
            job.state.tier = rs.DEVICE
            worker.used_bytes += job.state.state_bytes
        if self.t.waits_for_move(job, first, worker):
            return actions + self.swaps.bring_in(worker, job, room, now)
        for call in startable:
            if not self._may_start(worker, job, call, gate):
                break
            replicas, room = self.pool.replicate(worker, job, call, now)
            actions += replicas
            if not room:  # the turn waits for a replica's room here, or goes elsewhere
                if (too_large := self.pool.fits_nowhere(job)) is not None:
                    self.t.drop(job, call)
                    actions.append(Fail(job.job_id, call.call_id, too_large))
                else:
                    actions += self._room_for_turns(worker, now)
                break
            actions.append(self._start(worker, job, call, needs_state, now))
        return actions

    def _room_for_turns(self, worker: ScheduledWorker, now: float) -> list[Action]:
        """A turn waits for a replica's room on a rollout worker that still homes jobs (one lent to
        rollout): an idle home's state goes to host memory, as it would for a device over its
        budget, since no turn's end would ever free that room (its next call swaps it back in)."""
        if worker.role != "rollout" or worker.swapping is not None:
            return []
        victim = self.swaps.victim(worker, None, now)
        return self.swaps.evict(worker, victim) if victim is not None else []

    def _entries(self, worker: ScheduledWorker, now: float) -> Entries:
        """Each job's calls that may start on ``worker`` now, the jobs in the policy's order."""
        entries: Entries = []
        away = bool(self.t.rollout_ids)  # pooled jobs' turns run there
        for job_id in worker.jobs | worker.samplers:
            job = self.t.jobs[job_id]
            for lane in job.lanes_on(worker.worker_id, job.pooled and away):
                startable = self.t.startable(job, lane)
                if startable:
                    entries.append((job, startable))
        entries += self.pool.turns(worker)
        if len(entries) > 1:
            entries.sort(key=lambda e: self.t.policy.rank(self.t, worker, e[0], e[1][0], now))
        return entries

    def _may_start(self, worker: ScheduledWorker, job: ScheduledJob, call: ScheduledCall, gate: EngineGate) -> bool:
        """``call`` has a slot on ``worker`` (a trainer slot if it takes one) and its engines are in
        the state it needs (``gate``)."""
        if len(worker.running) >= worker.slots:
            return False
        if worker.takes_trainer_slot(call) and len(worker.training) >= worker.trainer_slots:
            return False
        return gate.lets_start(worker, job, self.engines.need(worker, call))

    def _start(
        self, worker: ScheduledWorker, job: ScheduledJob, call: ScheduledCall, needs_state: bool, now: float
    ) -> Dispatch:
        """Run ``call`` on ``worker`` now: its slot taken, its start charged."""
        if needs_state:
            job.state.waiting_since_s = None
            self.t.waiting.discard(job.job_id)
        job.queues[call.lane].remove(call.call_id)
        job.running[call.lane].add(call.call_id)
        job.rebuilding &= call.kind != "restore"
        worker.running.add(call.call_id)
        self.t.ran_on[call.call_id] = worker.worker_id
        if worker.takes_trainer_slot(call):
            worker.training.add(call.call_id)
        pooled_turn = job.pooled and call.lane == SAMPLER
        if pooled_turn:
            self.t.started[call.call_id] = now
        self.t.ledger.call_started(worker.worker_id, job.job_id, now)
        # A pooled turn's engine priority is its level (lower runs first): the MLFQ inside a bucket.
        priority = call.level if pooled_turn else call.priority
        exclusive = call.lane == TRAINER and self.pool.turns_left_on(worker)
        return Dispatch(call.call_id, worker.worker_id, priority, exclusive, own=self.t.own.get(call.call_id))
