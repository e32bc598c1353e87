"""Group jobs: a job on several devices lives on an aligned block (``groups.py``), its calls run as a gang."""

from __future__ import annotations

import dataclasses

from plexrl.coordinator import groups
from plexrl.coordinator import residency as rs
from plexrl.coordinator.events import Action, Dispatch, Fail, Place, Release
from plexrl.coordinator.residency import Residency
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
from plexrl.errors import NoWorkersError
from plexrl.plan import JobShape, footprint


class Gangs:
    """Where group jobs go, and their calls: one at a time, on every member at once."""

    def __init__(self, t: Tables, swaps: Swaps) -> None:
        self.t = t
        self.swaps = swaps

    def place(
        self,
        job_id: str,
        state_bytes: int,
        weight: float,
        base: str,
        devices: int,
        elsewhere: bool,
        now: float,
        shape: JobShape | None = None,
    ) -> list[Action]:
        """Place a group job on an aligned block of ``devices`` workers with room for its shard
        (by the plan where the workers have one and the job a ``shape``)."""
        if devices not in groups.GROUP_SIZES or elsewhere:
            why = (
                f"job {job_id} asks for {devices} devices{' and generates elsewhere' if elsewhere else ''}: a job "
                f"spans {', '.join(map(str, groups.GROUP_SIZES))} devices and generates on its own group"
            )
            return [Fail(job_id, None, NoWorkersError(why))]
        job = ScheduledJob(job_id, "", Residency(state_bytes, rs.HOST), weight=weight if weight > 0 else 1.0,
                           base=base, shape=shape)  # fmt: skip
        job.devices = devices
        if not self.t.homes():  # none registered yet: it waits for a group, as a job whose worker was lost
            self.t.jobs[job_id] = job
            self.t.ledger.job_opened(job_id, now)
            self.t.homeless[job_id] = (now, f"job {job_id} opened with no worker registered")
            return [Place(job_id, "")]
        chosen = self.choose(job, devices)
        if isinstance(chosen, NoWorkersError):
            return [Fail(job_id, None, chosen)]
        if chosen[0].plan is not None and shape is not None:
            job.state.state_bytes = footprint(chosen[0].plan, shape).state  # a member's share
        fits = all(w.used_bytes + job.state.state_bytes <= w.budget for w in chosen)
        job.state.tier = rs.DEVICE if fits else rs.HOST
        self.seat(job, chosen)
        self.t.jobs[job_id] = job
        self.t.ledger.job_opened(job_id, now)
        return [Place(job_id, job.home, "", members=job.members)]

    def choose(self, job: ScheduledJob, devices: int) -> list[ScheduledWorker] | NoWorkersError:
        """The least loaded aligned block whose members' budgets hold a shard (``dedicated``: a free one)."""

        def holds(w: ScheduledWorker) -> bool:
            size = job.state.state_bytes if w.plan is None or job.shape is None else footprint(w.plan, job.shape).state
            return size <= min(w.budget, self.t.room_alone(w, job))

        blocks = [b for b in groups.aligned_blocks(self.t.homes(), devices) if all(holds(w) for w in b)]
        if self.t.policy.name == "dedicated":
            blocks = [b for b in blocks if not any(w.jobs or w.samplers for w in b)]
        if not blocks:
            return NoWorkersError(
                f"no aligned block of {devices} workers on one node (indices i..i+{devices - 1}, i a multiple of "
                f"{devices}) has room for job {job.job_id}'s share of {job.state.state_bytes} bytes: start workers "
                "with --node and --index, close a job, or ask for more devices"
            )
        return list(groups.least_loaded(blocks, lambda w: len(w.jobs) + len(w.samplers)))

    def seat(self, job: ScheduledJob, members: list[ScheduledWorker]) -> None:
        job.members = tuple(w.worker_id for w in members)
        job.home = job.sampler = job.members[0]
        for w in members:
            w.jobs.add(job.job_id)
            w.fixed.update(self.t.fixes(w, job))
            if job.state.tier == rs.DEVICE:
                w.used_bytes += job.state.state_bytes

    def dispatch(self, job: ScheduledJob, startable: list[ScheduledCall], now: float) -> list[Action]:
        """Start the group's next call on all its members at once, or bring its shards in on all of them."""
        members = [self.t.registered[m] for m in job.members]
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
            self.t.waiting.discard(job.job_id)
            return self._start(job, members, first, now)
        self.swaps.wait(job, now)
        if job.state.tier != rs.HOST:
            return []  # swapping
        if room:
            return self.swaps.swap_group(job, rs.DEVICE)
        actions: list[Action] = []
        for w in members:  # make room on each member that lacks it
            if w.swapping is None and w.used_bytes + size > w.budget:
                victim = self.swaps.victim(w, job, now)
                if victim is not None:
                    actions += self.swaps.evict(w, victim)
        return actions

    def _start(
        self, job: ScheduledJob, members: list[ScheduledWorker], call: ScheduledCall, now: float
    ) -> list[Action]:
        """Claim every member (all or none: another group's claim comes first), and start ``call``
        once all have drained; the claim holds until the call ends (``Tables.free``)."""
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
            self.t.ledger.call_started(w.worker_id, job.job_id, now)
        self.t.ran_on[call.call_id] = job.home
        self.t.gangs[call.call_id] = (job.job_id, job.members)
        own = self.t.own.get(call.call_id)
        if own is not None and job.elastic:  # its restore gives the rollout workers that joined it its state
            own = dataclasses.replace(own, join=True)
        return [Dispatch(call.call_id, job.home, call.priority, own=own)]

    def unclaim(self, job: ScheduledJob) -> list[str]:
        """Drop the group's claim on its members if none of its calls runs (its ready call went away)."""
        if any(job.running.values()):
            return []
        for member in job.members:
            worker = self.t.registered.get(member)
            if worker is not None and worker.gang == job.job_id:
                worker.gang = ""
        return [m for m in job.members if m in self.t.registered]

    def disband(self, job: ScheduledJob, now: float, requeue: bool = False) -> list[str]:
        """Take a group job off its members (it closed, or lost a member): free each member's shard,
        slots and claim; its running calls go back to its queues (``requeue``) or are left unfinished
        (for ``Recovery.lose_job`` to fail). Returns the members still registered."""
        self.t.group_swaps.pop(job.job_id, None)
        self.t.swapping.pop(job.job_id, None)
        for lane in (SAMPLER, TRAINER):
            for call_id in sorted(job.running[lane]):
                self.t.free(call_id, job.job_id, now)
                job.running[lane].discard(call_id)
                if requeue:
                    self.t.enqueue(job, self.t.calls[call_id])
        survivors = [self.t.registered[m] for m in job.members if m in self.t.registered]
        for w in survivors:
            self.off(w, job)
        job.members = ()
        self.t.widened.discard(job.job_id)
        job.state.tier = rs.HOST
        return [w.worker_id for w in survivors]

    def narrow(self, job: ScheduledJob) -> tuple[list[Action], list[str]]:
        """The rollout workers helping train one-device ``job`` (``scheduler/elastic.py``) leave it:
        each closes its copy (``Release``) and takes turns again. Returns the actions and the
        workers whose dispatch may change (its home and its helpers)."""
        helpers = [self.t.registered[m] for m in job.members[1:] if m in self.t.registered]
        for w in helpers:
            self.off(w, job)
        home = self.t.registered.get(job.home)
        if home is not None and home.gang == job.job_id:  # its claim for a call that now runs there alone
            home.gang = ""
        touched = list(job.members)
        job.members = ()
        self.t.widened.discard(job.job_id)
        return [Release(w.worker_id, job.job_id) for w in helpers], touched

    def off(self, w: ScheduledWorker, job: ScheduledJob) -> None:
        """Take ``job`` off its member ``w``: its share there is free, and its slots and claim; a
        rollout worker that helped train it (``Elastic``) takes turns again."""
        if job.state.tier != rs.HOST:  # on the device, or on its way in or out: counted there
            w.used_bytes -= job.state.state_bytes
        if w.swapping is not None and w.swapping.job_id == job.job_id:
            w.swapping = None  # its SwapDone, when it comes, finds no swap to settle
        w.jobs.discard(job.job_id)
        self.t.unfix(w, job)
        if w.gang == job.job_id:
            w.gang = ""
        if w.lent_to == job.job_id:
            w.lent_to = ""
            self.t.roles_changed(w)
