"""Swaps: moving a job's state between a worker's device and host memory, and whose goes."""

from __future__ import annotations

from plexrl.coordinator import residency as rs
from plexrl.coordinator.events import Action, Swap
from plexrl.coordinator.scheduler.state import (
    ASLEEP,
    SAMPLER,
    GroupSwap,
    ScheduledJob,
    ScheduledWorker,
    SwapInFlight,
    Tables,
)
from plexrl.names import Tier
from plexrl.plan import TRAINING_KINDS, free_bytes


class Swaps:
    """One transfer at a time per worker; a group job's shards move on all its members together."""

    def __init__(self, t: Tables) -> None:
        self.t = t

    def room(self, worker: ScheduledWorker, size: int) -> bool:
        """Whether ``size`` more bytes of state fit ``worker``'s device now: within its budget, and,
        while a training call runs beside its awake engines, beside both."""
        if worker.used_bytes + size > worker.budget:
            return False
        if worker.plan is None or worker.engines == ASLEEP:
            return True
        calls = self.t.calls
        training = any(c in calls and calls[c].kind in TRAINING_KINDS for c in worker.running)
        both = sum(worker.parts())
        return not training or worker.used_bytes + size + both <= free_bytes(worker.plan)

    def bring_in(self, worker: ScheduledWorker, job: ScheduledJob, room: bool, now: float) -> list[Action]:
        """``job``'s next call waits for its state: swap it in if there is room, else swap another
        job's out if one should go (one transfer at a time per worker)."""
        self.wait(job, now)
        if worker.swapping is not None or job.state.tier != rs.HOST:
            return []
        if room:
            return [self._swap(worker, job, rs.DEVICE)]
        victim = self.victim(worker, job, now)
        return self.evict(worker, victim) if victim is not None else []

    def wait(self, job: ScheduledJob, now: float) -> None:
        """``job``'s next call waits for its state (from now, unless it waited already)."""
        if job.state.waiting_since_s is None:
            job.state.waiting_since_s = now
            self.t.waiting.add(job.job_id)

    def victim(self, worker: ScheduledWorker, waiting: ScheduledJob | None, now: float) -> ScheduledJob | None:
        """The resident, idle job to swap out so ``waiting`` can come in (or, with ``waiting`` None,
        so the device gets back under its budget), if any should go now. A closing job is not
        swapped: its close frees its state (seen when a close had finished on the worker but the
        job's ``JobClosed`` was not handled yet: the swap reached a worker that no longer had it)."""
        idle = [
            job
            for job in (self.t.jobs[j] for j in sorted(worker.jobs))
            if job.state.tier == rs.DEVICE
            and job.idle_on(worker.worker_id, sampler_apart=not self.t.needs_state(job, SAMPLER, worker))
            # A pooled turn on its home (a worker moved to rollout) keeps it, unless generates there use no state.
            and (worker.stateless_generates or not job.running[SAMPLER] & worker.running)
            and not job.closing
        ]
        return self.t.policy.victim(self.t, worker, idle, waiting, now) if idle else None

    def evict(self, worker: ScheduledWorker, victim: ScheduledJob) -> list[Action]:
        """Swap ``victim``'s state off ``worker`` (a group's off all its members, once none is moving)."""
        if not victim.members:
            return [self._swap(worker, victim, rs.HOST)]
        return self.swap_group(victim, rs.HOST)

    def swap_group(self, job: ScheduledJob, to: Tier) -> list[Action]:
        """Swap a group job's shards on all its members at once (none if one of them is swapping)."""
        members = [self.t.registered[m] for m in job.members]
        if any(w.swapping is not None for w in members):
            return []
        self.t.group_swaps[job.job_id] = GroupSwap(to, set(job.members))
        return [self._swap(w, job, to) for w in members]

    def done(self, job_id: str, worker_id: str, seconds: float, moved_bytes: int | None, ok: bool) -> list[str]:
        """A swap ended on ``worker_id`` (a group's: one member's shard): the job's state is where
        it put it (a failed one: where it was). Returns the workers that may start calls now."""
        if job_id in self.t.group_swaps:
            return self._group_done(job_id, worker_id, seconds, moved_bytes, ok)
        worker = self.t.registered.get(self.t.swapping.pop(job_id, ""))
        if worker is None:
            return []
        swap = self._settle(worker, job_id, seconds, moved_bytes, ok)
        if swap is None:
            return []
        job = self.t.jobs.get(job_id)
        on_device = (swap.to == rs.DEVICE) == ok  # a failed swap leaves the state where it was
        if job is None or not on_device:  # its room is free again (a swap in reserved it up front)
            worker.used_bytes -= swap.state_bytes
        if job is not None:
            job.state.tier = rs.DEVICE if on_device else rs.HOST
        return [worker.worker_id]

    def _swap(self, worker: ScheduledWorker, job: ScheduledJob, to: Tier) -> Swap:
        size = job.state.state_bytes
        worker.swapping = SwapInFlight(job.job_id, to, size)
        self.t.swapping[job.job_id] = worker.worker_id
        job.state.tier = rs.TO_DEVICE if to == rs.DEVICE else rs.TO_HOST
        if to == rs.DEVICE:
            worker.used_bytes += size  # reserved now, so nothing else takes the room
        return Swap(job.job_id, worker.worker_id, to, size)

    def _settle(
        self, worker: ScheduledWorker, job_id: str, seconds: float, moved_bytes: int | None, ok: bool
    ) -> SwapInFlight | None:
        """End ``worker``'s transfer of ``job_id``'s state (None: it has none): measured bandwidth
        refines the cost model, and the job is charged the seconds."""
        if worker.swapping is None or worker.swapping.job_id != job_id:
            return None
        swap, worker.swapping = worker.swapping, None
        moved = swap.state_bytes if moved_bytes is None else moved_bytes
        if ok and seconds > 0 and moved > 0:
            worker.bytes_per_s = 0.5 * worker.bytes_per_s + 0.5 * moved / seconds
        self.t.ledger.swapped(job_id, moved, seconds)
        return swap

    def _group_done(self, job_id: str, worker_id: str, seconds: float, moved_bytes: int | None, ok: bool) -> list[str]:
        """One member's shard swapped; once all have, the group's state is where they all put it
        (any failure: where it was, everywhere)."""
        group_swap = self.t.group_swaps[job_id]
        worker = self.t.registered.get(worker_id)
        swap = self._settle(worker, job_id, seconds, moved_bytes, ok) if worker is not None else None
        if swap is None:
            return []
        group_swap.pending.discard(worker_id)
        group_swap.ok &= ok
        if group_swap.pending:
            return [worker_id]  # it may start other jobs' calls meanwhile
        del self.t.group_swaps[job_id]
        self.t.swapping.pop(job_id, None)
        job = self.t.jobs.get(job_id)
        on_device = (group_swap.to == rs.DEVICE) == group_swap.ok
        members = [self.t.registered[m] for m in (job.members if job is not None else ()) if m in self.t.registered]
        for w in members:
            if not on_device:
                w.used_bytes -= swap.state_bytes
        if job is not None:
            job.state.tier = rs.DEVICE if on_device else rs.HOST
        return [w.worker_id for w in members] or [worker_id]
