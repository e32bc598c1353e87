"""Libra's elastic roles, as plexrl can have them: workers that hold jobs' homes (their trainers)
lend themselves to the rollout pool while their jobs are rolling out, and come back when a
job of theirs has training to do.

A job's trainer state stays on its home (affinity), so training cannot spread over more workers;
what moves is the home worker's spare time. A ``train`` worker whose homes have no trainer call
queued or running, while turns wait for rollout workers or the rollout workers batch ``LEND_LOAD``
turns or more each (every turn in a batch slows its steps), moves to ``rollout`` if the move is
expected to gain more than it costs: ``d`` devices more among ``n`` on rollout (a worker's
``devices``: a tensor-parallel one counts each) save at most ``d / (n + d)`` of the rollout time
left (all of it divisible work; less when a straggler's chain sets it), where that time is the least
expected remainder of the rollout phases its jobs are in (a running mean of a job's past phases,
from a ``sync_weights`` to the next ``forward_backward``, less the time this one has run; in a job's
first phase, the time it has run: a phase that has lasted t seconds is expected to last about t
more, as heavy-tailed durations do). A job between phases (training, or about to roll out again)
does not count: its trainer calls take the worker back when they come, and while they run it is not
lent at all. The saving must exceed ``margin`` times a move there and back (a rolling mean of the
last three measured moves, ``prior_move_s`` before any). So a home worker is lent to a small rollout
pool often and to a large one only for long rollouts. A ``rollout`` worker holding a home moves back
as soon as a trainer call of that home is submitted (training is on the critical path: the job's
next rollout waits for it). Moving is non-blocking: the worker stops taking turns (or homes) at
once, its running turns finish (paused while training taken back runs), its trainer calls run
throughout.

The other direction (``joins``, ``scheduler/elastic.py``): while no turn waits, idle rollout
workers join a job's training at an optimizer-step boundary, as data-parallel members (each
trains on one device, whatever its sampler spans), when ``d`` of them beside its home save
``d / (1 + d)`` of the training time left (its phases, from the first forward_backward after a
rollout to the next sync, measured as rollout phases are) beyond ``margin`` times a join and its
way back (a rolling mean of measured joins, the restore that gives the helpers the job's state;
``prior_move_s`` before any).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plexrl.names import Role

if TYPE_CHECKING:
    from plexrl.coordinator.scheduler import Scheduler
    from plexrl.coordinator.scheduler.state import ScheduledWorker

PHASE_WEIGHT = 0.5  # of the newest rollout phase in a job's running mean
LEND_LOAD = 2.0  # turns running per rollout worker from which another worker speeds rollout up (smaller batches)


@dataclass(slots=True)
class Rebalancer:
    prior_move_s: float = 10.0
    margin: float = 1.0
    _moves: deque[float] = field(default_factory=lambda: deque(maxlen=3))
    _phase_s: dict[str, float] = field(default_factory=dict)  # job -> mean rollout phase
    _phase_start: dict[str, float] = field(default_factory=dict)  # job -> when its current one started
    join: bool = True  # rollout workers may join jobs' training (``joins``)
    _joins: deque[float] = field(default_factory=lambda: deque(maxlen=3))
    _train_s: dict[str, float] = field(default_factory=dict)  # job -> mean training phase
    _train_start: dict[str, float] = field(default_factory=dict)  # job -> when its current one started

    def move_s(self) -> float:
        return sum(self._moves) / len(self._moves) if self._moves else self.prior_move_s

    def moved(self, seconds: float) -> None:
        self._moves.append(seconds)

    def join_s(self) -> float:
        return sum(self._joins) / len(self._joins) if self._joins else self.prior_move_s

    def joined(self, seconds: float) -> None:
        self._joins.append(seconds)

    def rollout_started(self, job_id: str, now: float) -> None:
        self._phase_start[job_id] = now
        start = self._train_start.pop(job_id, None)
        if start is not None:
            _mean_in(self._train_s, job_id, now - start)

    def training_started(self, job_id: str, now: float) -> None:
        start = self._phase_start.pop(job_id, None)
        if start is not None:
            _mean_in(self._phase_s, job_id, now - start)
            self._train_start[job_id] = now

    def forget(self, job_id: str) -> None:
        for table in (self._phase_s, self._phase_start, self._train_s, self._train_start):
            table.pop(job_id, None)

    def expected_rollout_left_s(self, job_id: str, now: float) -> float | None:
        """How much longer the job is expected to stay out of training; None when it is not rolling out."""
        return _left(self._phase_s, self._phase_start, job_id, now)

    def expected_training_left_s(self, job_id: str, now: float) -> float | None:
        """How much longer the job is expected to train before it rolls out again; None when it is not training."""
        return _left(self._train_s, self._train_start, job_id, now)

    def joins(self, s: Scheduler, job_ids: list[str], now: float) -> list[tuple[str, list[ScheduledWorker]]]:
        """(job, helpers): the idle rollout workers to join each of ``job_ids``' training now,
        while no turn waits for one (``Elastic.joinable``, ``Elastic.helpers``)."""
        if not self.join or s.queued_turns() > 0:
            return []
        plan: list[tuple[str, list[ScheduledWorker]]] = []
        taken: set[str] = set()
        for job_id in job_ids:
            left = self.expected_training_left_s(job_id, now)
            if left is None or not s.joinable(job_id):
                continue
            helpers = [w for w in s.helpers(job_id) if w.worker_id not in taken]
            if helpers and left * len(helpers) / (1 + len(helpers)) > self.margin * 2 * self.join_s():
                plan.append((job_id, helpers))
                taken.update(w.worker_id for w in helpers)
        return plan

    def plan(self, s: Scheduler, now: float) -> list[tuple[str, Role]]:
        """(worker, role) moves to make now."""
        moves: list[tuple[str, Role]] = []
        waiting = s.queued_turns() > 0 or s.rollout_load() >= LEND_LOAD
        rollout = sum(w.devices for w in s.workers() if w.role == "rollout" and not w.moving_to)
        for w in s.workers():
            if w.moving_to or not w.jobs or w.lent_to:  # (a helper leaves its job's training by itself)
                continue
            training = any(s.trainer_busy(j) for j in w.jobs)
            if w.role == "train" and waiting and not training:
                lefts = [left for j in w.jobs if (left := self.expected_rollout_left_s(j, now)) is not None]
                if lefts and min(lefts) * w.devices / (rollout + w.devices) > self.margin * 2 * self.move_s():
                    moves.append((w.worker_id, "rollout"))
                    rollout += w.devices
            elif w.role == "rollout" and training:
                moves.append((w.worker_id, "train"))
        return moves


def _mean_in(means: dict[str, float], job_id: str, took: float) -> None:
    """Fold a phase that ``took`` seconds into the job's running mean."""
    last = means.get(job_id)
    means[job_id] = took if last is None else (1 - PHASE_WEIGHT) * last + PHASE_WEIGHT * took


def _left(means: dict[str, float], starts: dict[str, float], job_id: str, now: float) -> float | None:
    """What is left of the phase the job is in, by its mean (in its first, as long as it has run:
    heavy-tailed durations); None when it is in no such phase."""
    start = starts.get(job_id)
    if start is None:
        return None
    mean, ran = means.get(job_id), now - start
    return ran if mean is None else max(0.0, mean - ran)
