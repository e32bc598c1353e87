"""The coordinator's scheduler on virtual time: workload models in place of workers and clients.

``Simulation`` feeds the *same* ``Scheduler`` object the coordinator uses the events a real
cluster would produce (workers join, jobs open, calls are submitted and finish) and carries out
its actions on a virtual clock: a ``Dispatch`` finishes after the call's modelled duration. Each
job runs its ``JobModel`` program, one call at a time as a GRPO script does. A device runs one
call at a time (workers join with one slot) and holds ``memory_bytes`` of jobs' state; a ``Swap``
moves a job's state at ``swap_bytes_per_s`` beside the running call (a side stream) and answers
with ``SwapDone``. A ``Tick`` every ``tick_s`` lets waiting jobs hit their starvation bound.
Deterministic for a given seed.

Device-hours are what a user pays for: a device is held from the first call it runs until the
last call it runs finishes. Under ``dedicated`` that is each job's wall time; when jobs share
devices it is the devices' common span.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from plexrl.coordinator import scheduler as sch
from plexrl.sim.workload import JobModel


@dataclass
class JobResult:
    name: str
    worker: str = ""
    started_s: float = 0.0
    finished_s: float | None = None  # None: did not finish (failed, or the run was cut short)
    accelerator_s: float = 0.0  # seconds its calls ran
    calls: int = 0
    error: str = ""

    @property
    def wall_s(self) -> float:
        return (self.finished_s if self.finished_s is not None else float("nan")) - self.started_s


@dataclass
class SimResult:
    policy: str
    jobs: list[JobResult]
    busy_s: dict[str, float]  # per worker: seconds with a call running
    held_s: dict[str, float]  # per worker: first call start to last call end
    end_s: float
    swaps: int = 0
    swap_s: float = 0.0

    @property
    def device_hours(self) -> float:
        return sum(self.held_s.values()) / 3600

    @property
    def busy_fraction(self) -> float:
        held = sum(self.held_s.values())
        return sum(self.busy_s.values()) / held if held else 0.0


@dataclass
class _Job:
    model: JobModel
    program: Iterator[tuple[str, str, float]]
    result: JobResult


@dataclass
class _Worker:
    busy_s: float = 0.0
    first_s: float | None = None
    last_s: float = 0.0


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    fire: Callable[[], None] = field(compare=False)


class Simulation:
    def __init__(
        self,
        policy: str,
        workers: int,
        jobs: list[JobModel],
        seed: int = 0,
        *,
        memory_bytes: float = float("inf"),
        swap_bytes_per_s: float = 25e9,
        tick_s: float = 1.0,
    ) -> None:
        self.policy = policy
        self.memory_bytes, self.swap_bytes_per_s, self.tick_s = memory_bytes, swap_bytes_per_s, tick_s
        self._swaps, self._swap_s, self._left = 0, 0.0, 0
        self.scheduler = sch.Scheduler(policy)
        self.now = 0.0
        self._events: list[_Event] = []
        self._seq = itertools.count()
        self._call_ids = itertools.count(1)
        self._workers = {f"w{i}": _Worker() for i in range(workers)}
        self._jobs: dict[str, _Job] = {}
        self._calls: dict[int, tuple[str, float]] = {}  # call id -> (job id, duration)
        seeds = np.random.SeedSequence(seed).spawn(len(jobs))
        for i, (model, s) in enumerate(zip(jobs, seeds, strict=True)):
            job_id = f"{model.name}-{i}"
            self._jobs[job_id] = _Job(model, _program(model, np.random.default_rng(s)), JobResult(model.name))

    def run(self, until_s: float = float("inf")) -> SimResult:
        for w in self._workers:
            self._handle(sch.WorkerJoined(w, memory_bytes=self.memory_bytes, swap_bytes_per_s=self.swap_bytes_per_s))
        for job_id, job in self._jobs.items():
            self._handle(sch.JobOpened(job_id, job.model.state_bytes))
        self._left = sum(1 for j in self._jobs.values() if not j.result.error)
        if self.memory_bytes != float("inf"):
            self._at(self.tick_s, self._tick)
        while self._events and self._events[0].t <= until_s:
            event = heapq.heappop(self._events)
            self.now = event.t
            event.fire()
        return SimResult(
            policy=self.policy,
            jobs=[j.result for j in self._jobs.values()],
            busy_s={w: r.busy_s for w, r in self._workers.items()},
            held_s={w: r.last_s - r.first_s for w, r in self._workers.items() if r.first_s is not None},
            end_s=self.now,
            swaps=self._swaps,
            swap_s=self._swap_s,
        )

    def _tick(self) -> None:
        self._handle(sch.Tick())
        if self._left:
            self._at(self.now + self.tick_s, self._tick)

    # -- the scheduler seam, as in the coordinator's server --------------------------------------

    def _handle(self, event: sch.Event) -> None:
        for action in self.scheduler.handle(event, self.now):
            match action:
                case sch.Place(job_id, worker_id):
                    job = self._jobs[job_id]
                    job.result.worker, job.result.started_s = worker_id, self.now
                    self._advance(job_id)
                case sch.Dispatch(call_id, worker_id):
                    self._start(call_id, worker_id)
                case sch.Fail(job_id, _, error):
                    self._jobs[job_id].result.error = error.message
                case sch.Swap(job_id, _, _, state_bytes):
                    seconds = state_bytes / self.swap_bytes_per_s
                    self._swaps += 1
                    self._swap_s += seconds
                    self._at(self.now + seconds, functools.partial(self._handle, sch.SwapDone(job_id, seconds)))

    def _at(self, t: float, fire: Callable[[], None]) -> None:
        heapq.heappush(self._events, _Event(t, next(self._seq), fire))

    def _advance(self, job_id: str) -> None:
        """Run the job's program up to its next call (tool waits pass on the virtual clock)."""
        job = self._jobs[job_id]
        step = next(job.program, None)
        if step is None:
            job.result.finished_s = self.now
            self._left -= 1
            self._handle(sch.JobClosed(job_id))
            return
        what, kind, seconds = step
        if what == "wait":
            self._at(self.now + seconds, lambda: self._advance(job_id))
            return
        call_id = next(self._call_ids)
        self._calls[call_id] = (job_id, seconds)
        self._handle(sch.CallSubmitted(call_id, job_id, kind))

    def _start(self, call_id: int, worker_id: str) -> None:
        job_id, seconds = self._calls.pop(call_id)
        worker = self._workers[worker_id]
        if worker.first_s is None:
            worker.first_s = self.now
        result = self._jobs[job_id].result
        result.accelerator_s += seconds
        result.calls += 1

        def finish() -> None:
            worker.busy_s += seconds
            worker.last_s = self.now
            self._handle(sch.CallFinished(call_id))
            self._advance(job_id)

        self._at(self.now + seconds, finish)


def _program(model: JobModel, rng: np.random.Generator) -> Iterator[tuple[str, str, float]]:
    """The job's calls and tool waits: ("call", kind, seconds) or ("wait", "tool", seconds)."""
    for _ in range(model.steps):
        tokens = 0
        for turn in range(model.turns):
            if turn:
                yield ("wait", "tool", model.tool_s(rng))
            seconds, produced = model.generate_s(rng)
            tokens += produced
            yield ("call", "generate", seconds)
        yield ("call", "forward_backward", tokens * model.train_s_per_token)
        yield ("call", "optim_step", model.optim_step_s)
        yield ("call", "sync_weights", model.sync_s)
