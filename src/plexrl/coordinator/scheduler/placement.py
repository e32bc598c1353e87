"""Placement: a one-device job's home (and sampler) worker, and what homing it fixes on the device."""

from __future__ import annotations

from plexrl.coordinator import residency as rs
from plexrl.coordinator.events import Action, Fail, Place
from plexrl.coordinator.residency import Residency
from plexrl.coordinator.scheduler.state import ScheduledJob, ScheduledWorker, Tables
from plexrl.errors import JobTooLargeError, NoWorkersError
from plexrl.plan import JobShape, footprint, gib, refusal


class Placement:
    """Homes by the policy among the workers a job's state fits, sized by each worker's memory plan."""

    def __init__(self, t: Tables) -> None:
        self.t = t

    def place(
        self,
        job_id: str,
        state_bytes: int,
        weight: float,
        base: str,
        disaggregated: bool,
        now: float,
        shape: JobShape | None = None,
    ) -> list[Action]:
        job = ScheduledJob(job_id, "", Residency(state_bytes, rs.HOST), weight=weight if weight > 0 else 1.0,
                           base=base, shape=shape)  # fmt: skip
        if not self.t.homes() and not disaggregated:
            # None registered yet (the coordinator just started, or restarted and its workers are
            # registering again; or only rollout workers): it waits for one like a job whose worker was lost.
            self.t.jobs[job_id] = job
            self.t.ledger.job_opened(job_id, now)
            why = f"job {job_id} opened with no worker registered (start one with `plexrl worker --coordinator ADDR`)"
            self.t.homeless[job_id] = (now, why)
            return [Place(job_id, "")]
        chosen = self.choose(job, disaggregated, now)
        if isinstance(chosen, NoWorkersError):
            return [Fail(job_id, None, chosen)]
        worker = chosen
        self.home(worker, job)
        # A new job's state starts on the device if it fits there, else in host memory.
        fits = worker.used_bytes + job.state.state_bytes <= worker.budget
        job.state.tier = rs.DEVICE if fits else rs.HOST
        sampler = worker
        if disaggregated:
            chosen_sampler = self.t.policy.sampler([w for w in self.t.homes() if w is not worker])
            assert chosen_sampler is not None, "choose() leaves a second worker for a disaggregated job"
            sampler = chosen_sampler
            sampler.samplers.add(job_id)
        job.sampler = sampler.worker_id
        self.t.jobs[job_id] = job
        if fits:
            worker.used_bytes += job.state.state_bytes
        self.t.ledger.job_opened(job_id, now)
        return [Place(job_id, worker.worker_id, sampler.worker_id if disaggregated else "")]

    def choose(self, job: ScheduledJob, disaggregated: bool, now: float) -> ScheduledWorker | NoWorkersError:
        """The home worker for a job (new, or one whose home was lost), or why there is none."""
        homes = self.t.homes()
        if not homes:
            return NoWorkersError(
                "no worker that takes jobs' homes is registered (rollout workers take none): start one with "
                "`plexrl worker --coordinator ADDR`"
            )
        if disaggregated and len(homes) < 2:
            return NoWorkersError(
                "a disaggregated job needs two workers (trainer and sampler): start another worker, "
                "or open the job colocated"
            )
        fitting = [w for w in homes if self._room_alone(w, job) >= self._state_bytes(w, job)]
        if not fitting:
            return self._too_large(job, homes)
        return self.t.policy.place(self.t, fitting, job.state.state_bytes, job.base, disaggregated, now)

    def home(self, worker: ScheduledWorker, job: ScheduledJob) -> None:
        """Make ``worker`` the job's home: what it fixes there is counted, its state sized by the plan."""
        worker.jobs.add(job.job_id)
        job.home = worker.worker_id
        worker.fixed.update(self.t.fixes(worker, job))
        if worker.plan is not None and job.shape is not None:
            job.state.state_bytes = footprint(worker.plan, job.shape).state

    def unhome(self, worker: ScheduledWorker, job: ScheduledJob) -> None:
        """The job leaves ``worker``: what it fixed there is released (its base with its last job)."""
        worker.jobs.discard(job.job_id)
        self.t.unfix(worker, job)

    def resize(self, job_id: str, state_bytes: int) -> str | None:
        """The job's state measured at ``state_bytes``: its home (and members) count that from now on."""
        job = self.t.jobs.get(job_id)
        if job is None or job.state.tier not in (rs.DEVICE, rs.HOST):
            return None  # sizes arrive with the opening call, which runs on the device: not in transit
        if job.state.tier == rs.DEVICE:
            for member in job.members or (job.home,):
                self.t.registered[member].used_bytes += state_bytes - job.state.state_bytes
        job.state.state_bytes = state_bytes
        return job.home

    def _state_bytes(self, worker: ScheduledWorker, job: ScheduledJob) -> int:
        """The job's movable state on ``worker``: the plan's, or as sized so far."""
        if worker.plan is None or job.shape is None:
            return job.state.state_bytes
        return footprint(worker.plan, job.shape).state

    def _room_alone(self, worker: ScheduledWorker, job: ScheduledJob) -> float:
        """The room ``job``'s movable state would have on ``worker`` with every other job's swapped out."""
        return self.t.room(worker, self.t.fixes(worker, job))

    def _too_large(self, job: ScheduledJob, homes: list[ScheduledWorker]) -> NoWorkersError:
        """Why no worker can hold ``job``, with the plan's numbers."""
        planned = [w for w in homes if w.plan is not None]
        if job.shape is None or not planned:
            most = max(w.budget for w in homes)
            size = job.state.state_bytes
            return NoWorkersError(f"job state of {size} bytes fits no worker (largest budget {most:.0f} bytes)")
        best = max(planned, key=lambda w: self._room_alone(w, job))
        assert best.plan is not None
        why = refusal(best.plan, job.shape, footprint(best.plan, job.shape))
        if why is None:  # it fits an empty worker: what else holds the best one's device
            others = ", ".join(f"{k} {gib(v)}" for k, v in best.fixed.items())
            why = (
                f"it needs {gib(self._state_bytes(best, job))} for its state beside {others or 'nothing'}, "
                f"and the budget is {gib(best.memory_bytes)}"
            )
        return JobTooLargeError(
            f"job {job.job_id} fits no worker: on {best.worker_id} ({best.plan.device_type}, "
            f"{gib(best.plan.capacity_bytes)}, {best.plan.dtype}) {why}. Use a smaller model or LoRA rank, "
            "a smaller --max-tokens-per-microbatch, a worker with more memory"
            + (
                ", or a gang of workers sharing its state (plexrl.job(..., devices=2))"
                if job.shape.lora_rank == 0
                else ""
            )
        )
