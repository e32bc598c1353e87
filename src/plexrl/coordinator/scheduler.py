"""The scheduler: a pure policy object. Events in, actions out; no I/O, no clock of its own.

The coordinator's server feeds it real events on real time; ``plexrl.sim`` will feed the same
object virtual events. Time (``now``) is an argument, ties are broken by submission order, so a
run replays exactly.

Invariants it keeps, whatever the policy:
- a job's calls run one at a time, in submission order, on the job's home worker (affinity);
- a worker runs at most ``slots`` calls at once;
- every submitted call ends in exactly one ``Dispatch`` followed by the server's
  ``CallFinished``, or in one ``Fail``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from plexrl.errors import NoWorkersError, PlexError, WorkerLostError

# -- events (server -> scheduler) --------------------------------------------------------------


@dataclass(frozen=True)
class WorkerJoined:
    worker_id: str
    slots: int = 1  # calls the worker may run at once


@dataclass(frozen=True)
class WorkerLost:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class JobOpened:
    job_id: str


@dataclass(frozen=True)
class JobClosed:
    job_id: str


@dataclass(frozen=True)
class CallSubmitted:
    call_id: int  # increasing in submission order
    job_id: str
    kind: str  # "generate", "forward_backward", ...


@dataclass(frozen=True)
class CallFinished:
    call_id: int


@dataclass(frozen=True)
class CallCancelled:
    """The caller gave up: a queued call leaves its queue; a running one runs until the worker
    reports it (aborted or finished) with ``CallFinished``."""

    call_id: int


Event = WorkerJoined | WorkerLost | JobOpened | JobClosed | CallSubmitted | CallFinished | CallCancelled

# -- actions (scheduler -> server) -------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """The job's trainer state lives on ``worker_id`` for the job's life."""

    job_id: str
    worker_id: str


@dataclass(frozen=True)
class Dispatch:
    call_id: int
    worker_id: str
    priority: int = 0  # for the worker's engine queue (vLLM): lower runs first


@dataclass(frozen=True)
class Fail:
    """Fail the call (or, with ``call_id`` None, the job's opening) with ``error``."""

    job_id: str
    call_id: int | None
    error: PlexError


Action = Place | Dispatch | Fail

# -- state -------------------------------------------------------------------------------------


@dataclass
class _Worker:
    worker_id: str
    slots: int
    running: set[int] = field(default_factory=set)
    jobs: set[str] = field(default_factory=set)
    busy_since: float | None = None
    busy_s: float = 0.0


@dataclass
class _Job:
    job_id: str
    home: str
    queue: deque[int] = field(default_factory=deque)
    running: int | None = None
    lost: str | None = None  # why the job's state is gone


@dataclass(frozen=True)
class _Call:
    call_id: int
    job_id: str
    kind: str


POLICIES = ("fifo", "dedicated")  # dedicated: one job per worker, the baseline users have today


class Scheduler:
    """``handle(event, now)`` returns the actions the server must carry out, in order."""

    def __init__(self, policy: str = "fifo") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self._workers: dict[str, _Worker] = {}
        self._jobs: dict[str, _Job] = {}
        self._calls: dict[int, _Call] = {}

    # -- queries (for status and accounting) ----------------------------------------------------

    def home_of(self, job_id: str) -> str | None:
        job = self._jobs.get(job_id)
        return job.home if job else None

    def queued(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        return len(job.queue) if job else 0

    def is_running(self, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return bool(job and job.running is not None)

    def busy_s(self, worker_id: str, now: float) -> float:
        w = self._workers[worker_id]
        return w.busy_s + (now - w.busy_since if w.busy_since is not None else 0.0)

    # -- events ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        actions: list[Action] = []
        touched: str | None = None  # the one worker that may now start a call (dispatch looks only there)
        match event:
            case WorkerJoined(worker_id, slots):
                self._workers[worker_id] = _Worker(worker_id, max(1, slots))
                touched = worker_id
            case WorkerLost(worker_id, reason):
                actions += self._lose_worker(worker_id, reason, now)
            case JobOpened(job_id):
                actions += self._place(job_id)
            case JobClosed(job_id):
                job = self._jobs.pop(job_id, None)
                if job and job.home in self._workers:
                    self._workers[job.home].jobs.discard(job_id)
            case CallSubmitted(call_id, job_id, kind):
                actions += self._submit(_Call(call_id, job_id, kind))
                touched = self.home_of(job_id)
            case CallFinished(call_id):
                call = self._calls.get(call_id)
                touched = self.home_of(call.job_id) if call is not None else None
                self._finish(call_id, now)
            case CallCancelled(call_id):
                self._cancel(call_id)
        if touched is not None and touched in self._workers:
            actions += self._dispatch(self._workers[touched], now)
        return actions

    def _place(self, job_id: str) -> list[Action]:
        if not self._workers:
            err = NoWorkersError("no workers are registered: start one with `plexrl worker --coordinator ADDR`")
            return [Fail(job_id, None, err)]
        if self.policy == "dedicated":
            free = [w for w in self._workers.values() if not w.jobs]
            if not free:
                err = NoWorkersError(
                    f"policy 'dedicated' runs one job per worker and all {len(self._workers)} workers hold "
                    "a job: add a worker, close a job, or use a multiplexing policy"
                )
                return [Fail(job_id, None, err)]
        # Fewest jobs first; ties go to the worker that joined first (dicts keep insertion order).
        worker = min(self._workers.values(), key=lambda w: len(w.jobs))
        worker.jobs.add(job_id)
        self._jobs[job_id] = _Job(job_id, worker.worker_id)
        return [Place(job_id, worker.worker_id)]

    def _submit(self, call: _Call) -> list[Action]:
        job = self._jobs.get(call.job_id)
        if job is None:
            raise KeyError(f"call {call.call_id} for unplaced job {call.job_id}")
        if job.lost is not None:
            return [Fail(call.job_id, call.call_id, WorkerLostError(job.lost))]
        self._calls[call.call_id] = call
        job.queue.append(call.call_id)
        return []

    def _finish(self, call_id: int, now: float) -> None:
        call = self._calls.pop(call_id, None)
        if call is None:
            return  # already failed (its worker was declared lost first)
        job = self._jobs.get(call.job_id)
        if job is None:
            return
        job.running = None
        worker = self._workers.get(job.home)
        if worker is not None:
            worker.running.discard(call_id)
            if not worker.running and worker.busy_since is not None:
                worker.busy_s += now - worker.busy_since
                worker.busy_since = None

    def _cancel(self, call_id: int) -> None:
        call = self._calls.get(call_id)
        job = self._jobs.get(call.job_id) if call is not None else None
        if job is not None and call_id in job.queue:
            job.queue.remove(call_id)
            del self._calls[call_id]

    def _lose_worker(self, worker_id: str, reason: str, now: float) -> list[Action]:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return []
        actions: list[Action] = []
        for job_id in sorted(worker.jobs):
            job = self._jobs[job_id]
            job.lost = (
                f"worker {worker_id} holding job {job_id}'s state was lost ({reason}); its unsaved "
                "training state is gone: open the job again and load its last checkpoint"
            )
            pending = ([job.running] if job.running is not None else []) + list(job.queue)
            for call_id in pending:
                self._calls.pop(call_id, None)
                actions.append(Fail(job_id, call_id, WorkerLostError(job.lost)))
            job.queue.clear()
            job.running = None
        return actions

    def _dispatch(self, worker: _Worker, now: float) -> list[Action]:
        """Start what ``worker`` can start (an event changes that for at most one worker)."""
        actions: list[Action] = []
        while len(worker.running) < worker.slots:
            ready = [self._jobs[j] for j in worker.jobs if self._jobs[j].queue and self._jobs[j].running is None]
            if not ready:
                break
            job = min(ready, key=lambda j: j.queue[0])  # oldest head call first
            call_id = job.queue.popleft()
            job.running = call_id
            worker.running.add(call_id)
            if worker.busy_since is None:
                worker.busy_since = now
            actions.append(Dispatch(call_id, worker.worker_id))
        return actions
