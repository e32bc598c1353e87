"""Calls: into their job's lane queues in the job's order, out when they finish or are cancelled."""

from __future__ import annotations

from plexrl.coordinator.events import Action, Fail
from plexrl.coordinator.scheduler.pool import Pool
from plexrl.coordinator.scheduler.state import (
    BARRIERS,
    SAMPLER,
    ScheduledCall,
    ScheduledJob,
    Tables,
    lane_of,
)
from plexrl.names import CallKind


class Calls:
    """A job's calls and where each lane runs: its home, its sampler worker, or the rollout pool."""

    def __init__(self, t: Tables, pool: Pool) -> None:
        self.t = t
        self.pool = pool

    def new(
        self,
        call_id: int,
        job_id: str,
        kind: CallKind,
        priority: int = 0,
        front: bool = False,
        trajectory: str = "",
        level: int = 0,
    ) -> ScheduledCall:
        """The call's record, its place in the job's order given (a ``front`` call goes first)."""
        job = self.t.jobs.get(job_id)
        if job is None:
            raise KeyError(f"call {call_id} for unplaced job {job_id}")
        seq = call_id
        if front:
            job.first_seq -= 1
            seq = job.first_seq
        return ScheduledCall(call_id, job_id, kind, priority, seq, trajectory, level, lane_of(kind))

    def submit(self, call: ScheduledCall, now: float) -> list[Action]:
        """Queue the call (a lost job's fails at once)."""
        job = self.t.jobs.get(call.job_id)
        if job is None:
            raise KeyError(f"call {call.call_id} for unplaced job {call.job_id}")
        if job.lost is not None:
            return [Fail(call.job_id, call.call_id, job.lost)]
        self.t.calls[call.call_id] = call
        lanes = self.t.state_lanes(job)
        idle = not any(job.queues[lane] or job.running[lane] for lane in lanes)
        if call.lane in lanes and idle and job.state.last_done_s is not None:
            job.state.observe_gap(now - job.state.last_done_s)  # it was idle since its last call
        self.t.enqueue(job, call)
        job.unfinished.add(call.call_id)
        if call.kind in BARRIERS:
            job.barriers.add(call.call_id)
        job.closing |= call.kind == "close"
        return []

    def finish(self, call_id: int, now: float) -> None:
        """The call ended (well or not): its slot is free, whatever became of its job."""
        call = self.t.calls.pop(call_id, None)
        self.t.own.pop(call_id, None)
        self.t.free(call_id, call.job_id if call is not None else "", now)
        job = self.t.jobs.get(call.job_id) if call is not None else None
        if call is None or job is None:
            return  # already failed (its worker was declared lost first), or its job is gone
        job.running[call.lane].discard(call_id)
        job.unfinished.discard(call_id)
        job.barriers.discard(call_id)
        if call.lane in self.t.state_lanes(job):
            job.state.last_done_s = now

    def cancel(self, call_id: int) -> ScheduledJob | None:
        """Take a queued call out of its queue (a running one runs on); its job."""
        call = self.t.calls.get(call_id)
        job = self.t.jobs.get(call.job_id) if call is not None else None
        if job is not None and call is not None and call_id in job.queues[call.lane]:
            self.t.drop(job, call)
        return job

    def lane_workers(self, call: ScheduledCall) -> list[str]:
        """Where the call's lane runs: its home or sampler worker, or for a pooled job's turn the
        rollout workers (``Pool.route``)."""
        job = self.t.jobs.get(call.job_id)
        if job is None:
            return []
        if call.lane == SAMPLER and self.t.pooled_away(job):
            return self.pool.route(job, call)
        return [job.sampler if call.lane == SAMPLER else job.home]

    def other_workers(self, call: ScheduledCall) -> list[str]:
        """Where the job's other lane runs: the call's end may let a call start there (a barrier)."""
        job = self.t.jobs.get(call.job_id)
        if job is None:
            return []
        if call.lane == SAMPLER:
            return [job.home]
        if self.t.pooled_away(job):
            return sorted(w.worker_id for w in self.t.rollout())
        return [job.sampler]
