"""Scheduling policies: where a job goes, which ready call starts first, whose state leaves a device.

The scheduler keeps the invariants (order, affinity, slots, budgets); a policy only chooses
among what they allow. ``dedicated``: one job per worker, the baseline users have today.
``fifo``: jobs share workers, oldest call first, state moved in and out on demand (least
recently used out). ``plex``: jobs packed by expected load and base model; calls that need no move first,
then calls that unblock a whole stage (``CRITICAL``), then the job furthest below its weighted
fair share of accelerator-seconds; state moved out only when that pays
(``residency.pays_to_evict``) or a waiting job starves.

A policy sees the scheduler's records through read-only protocols (``WorkerFacts``, ``JobFacts``,
``CallFacts``, ``SchedulerFacts``): mypy holds it to choosing among them, never changing them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar, Protocol, TypeVar

from plexrl.coordinator import residency as rs
from plexrl.coordinator.accounting import Ledger
from plexrl.errors import NoWorkersError
from plexrl.names import CallKind, Role

# -- what a policy sees of the scheduler's records


class WorkerFacts(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def jobs(self) -> AbstractSet[str]: ...  # jobs whose home it is
    @property
    def samplers(self) -> AbstractSet[str]: ...  # disaggregated jobs whose generates run there
    @property
    def role(self) -> Role: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def budget(self) -> float: ...
    @property
    def bytes_per_s(self) -> float: ...


class JobFacts(Protocol):
    @property
    def job_id(self) -> str: ...
    @property
    def base(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def state(self) -> rs.Residency: ...


class CallFacts(Protocol):
    @property
    def call_id(self) -> int: ...
    @property
    def kind(self) -> CallKind: ...


class SchedulerFacts(Protocol):
    @property
    def ledger(self) -> Ledger: ...
    def workers(self) -> Sequence[WorkerFacts]: ...
    def job(self, job_id: str) -> JobFacts: ...
    def waits_for_move(self, job: Any, call: Any, worker: Any) -> bool: ...


W = TypeVar("W", bound=WorkerFacts)  # a policy returns one of the workers it was given
J = TypeVar("J", bound=JobFacts)  # and one of the jobs

NEW_JOB_LOAD = 0.5  # plex: the busy fraction a job is expected to need until it has been observed
OBSERVE_S = 300.0  # plex: a job's own busy fraction replaces the guess after this long
PACK_LOAD = 1.0  # plex: a new job goes where the expected busy fractions leave room for it
CRITICAL = frozenset({"open", "close", "optim_step", "sync_weights"})  # short, and the next stage waits on them


class Policy:
    """The choices a scheduler leaves open; this base is ``fifo``'s."""

    name: ClassVar[str] = "fifo"

    def place(
        self, s: SchedulerFacts, fitting: Sequence[W], state_bytes: int, base: str, disaggregated: bool, now: float
    ) -> W | NoWorkersError:
        """The home for a job (new, or re-homed) among the workers its state fits."""
        return min(fitting, key=lambda w: len(w.jobs))  # fewest jobs; ties: the worker that joined first

    def sampler(self, others: Sequence[W]) -> W | None:
        """A disaggregated job's sampler worker among the workers other than its home."""
        return min(others, key=lambda w: (len(w.samplers), len(w.jobs)), default=None)

    def rank(
        self, s: SchedulerFacts, worker: WorkerFacts, job: JobFacts, call: CallFacts, now: float
    ) -> tuple[Any, ...]:
        """The order in which ``worker``'s ready lanes start (lowest first)."""
        return (call.call_id,)  # the oldest call first

    def victim(
        self, s: SchedulerFacts, worker: WorkerFacts, idle: Sequence[J], waiting: JobFacts | None, now: float
    ) -> J | None:
        """Which of ``idle`` (resident, nothing running) to move to host memory so ``waiting`` can
        come in (None: the device is over its budget), or None to move nothing now."""
        return min(idle, key=lambda j: j.state.last_done_s if j.state.last_done_s is not None else -math.inf)


class Fifo(Policy):
    name = "fifo"


class Dedicated(Policy):
    name = "dedicated"

    def place(
        self, s: SchedulerFacts, fitting: Sequence[W], state_bytes: int, base: str, disaggregated: bool, now: float
    ) -> W | NoWorkersError:
        free = [w for w in fitting if not w.jobs and not w.samplers]  # a worker of its own
        idle = [w for w in s.workers() if not w.jobs and not w.samplers and w.role != "rollout"]
        if not free or (disaggregated and len(idle) < 2):
            return NoWorkersError(
                "policy 'dedicated' runs one job per worker (a disaggregated job takes two) and not enough "
                "workers are free: add a worker, close a job, or use a multiplexing policy"
            )
        return super().place(s, free, state_bytes, base, disaggregated, now)

    def sampler(self, others: Sequence[W]) -> W | None:
        return super().sampler([w for w in others if not w.jobs and not w.samplers])


class Plex(Policy):
    name = "plex"

    def place(
        self, s: SchedulerFacts, fitting: Sequence[W], state_bytes: int, base: str, disaggregated: bool, now: float
    ) -> W | NoWorkersError:
        """Fill devices instead of spreading jobs thin, and keep a base model's jobs together (their
        generates batch). Among workers with room (expected busy fraction and device memory): the
        fullest whose jobs share this job's base, else an empty one, else the fullest. With room
        nowhere: the least loaded worker of its base, else the least loaded."""
        loads = {w.worker_id: sum(self.load(s, j, now) for j in w.jobs) for w in fitting}
        same_base = {w.worker_id for w in fitting if any(s.job(j).base == base for j in w.jobs)}
        room = [
            w
            for w in fitting
            if loads[w.worker_id] + NEW_JOB_LOAD <= PACK_LOAD + 1e-9 and w.used_bytes + state_bytes <= w.budget
        ]
        if not room:
            # A full pool: its load is shared anyway, so its base decides (a base alone on a
            # device pays the whole weight read of every decode step).
            return min([w for w in fitting if w.worker_id in same_base] or fitting, key=lambda w: loads[w.worker_id])
        same = [w for w in room if w.worker_id in same_base]
        if same:  # the fullest of them
            return min(same, key=lambda w: -loads[w.worker_id])
        empty = [w for w in room if not w.jobs]  # a device of its own rather than one on another base
        return empty[0] if empty else min(room, key=lambda w: -loads[w.worker_id])

    def load(self, s: SchedulerFacts, job_id: str, now: float) -> float:
        """The busy fraction a job needs of its device: observed once it has run a while."""
        usage = s.ledger.jobs.get(job_id)
        if usage is None or usage.wall_s(now) < OBSERVE_S:
            return NEW_JOB_LOAD
        return s.ledger.accelerator_s(job_id, now) / usage.wall_s(now)

    def rank(
        self, s: SchedulerFacts, worker: WorkerFacts, job: JobFacts, call: CallFacts, now: float
    ) -> tuple[Any, ...]:
        """Calls that can start without a move first; then calls that unblock a stage; then the job
        furthest below its weighted fair share of accelerator-seconds; then the oldest call."""
        served = s.ledger.accelerator_s(job.job_id, now) / job.weight
        return (s.waits_for_move(job, call, worker), call.kind not in CRITICAL, served, call.call_id)

    def victim(
        self, s: SchedulerFacts, worker: WorkerFacts, idle: Sequence[J], waiting: JobFacts | None, now: float
    ) -> J | None:
        if waiting is not None:
            paying = [j for j in idle if rs.pays_to_evict(j.state, worker.bytes_per_s)]
            if paying:
                return max(paying, key=lambda j: j.state.expected_gap_s or 0.0)
            if not rs.starving(waiting.state, now, worker.bytes_per_s):
                return None
        return super().victim(s, worker, idle, waiting, now)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fifo, Dedicated, Plex)}
