"""Libra's bucket scheduler: the level of an agent's next turn, and the bucket and vLLM priority
that level gets, from what its trajectory has shown at its tool boundaries (a multi-level
feedback queue on causal signals, not length predictions).

A trajectory starts at level 0 and only moves down the queue (to higher levels): when the
accelerator time its turns have received crosses a ``service_s`` threshold (attained service,
as in Autellix), and for each signal seen at a tool boundary that says the trajectory will run
long: a tool error or a retry (the agent will try again), ``turns_per_level`` turns taken, its
tokens past ``budget_fraction`` of its token budget. Its level is computed when a turn is
submitted, so a trajectory changes buckets only between turns.

A bucket is a group of rollout workers of one configuration, declared at worker start with the
lowest level it serves (``plexrl worker --role rollout --bucket LEVEL``): e.g. bucket 0 with wide
batches for the many short trajectories, bucket 2 with narrow, fast decode steps for the
stragglers that would otherwise set the rollout's makespan. A turn of level L goes to the
highest bucket at or below L (the lowest bucket if none is); inside a bucket, lower levels are
admitted first (the vLLM request priority is the level).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

from plexrl.coordinator.events import TurnSignals


@dataclass(frozen=True, slots=True)
class Mlfq:
    """The levels and what moves a trajectory down them."""

    levels: int = 4
    service_s: tuple[float, ...] = (2.0, 8.0, 32.0)  # attained accelerator-seconds at which levels 1, 2, 3 start
    turns_per_level: int = 4  # every this many turns taken: one level down
    errors_per_level: int = 1  # every this many tool errors or retries: one level down
    budget_fraction: float = 0.5  # tokens past this share of the budget: one level down

    def level(self, signals: TurnSignals, service_s: float) -> int:
        by_service = bisect.bisect_right(self.service_s, service_s)
        by_signals = (signals.tool_errors + signals.retries) // max(1, self.errors_per_level)
        by_signals += signals.turn // max(1, self.turns_per_level)
        if signals.token_budget > 0 and signals.tokens >= self.budget_fraction * signals.token_budget:
            by_signals += 1
        return min(self.levels - 1, by_service + by_signals)


def bucket_for(level: int, buckets: list[int]) -> int:
    """The bucket (its lowest level) serving ``level`` among ``buckets`` (sorted, not empty)."""
    at = bisect.bisect_right(buckets, level)
    return buckets[at - 1] if at else buckets[0]


@dataclass(slots=True)
class Trajectory:
    """What the scheduler remembers of one trajectory between its turns."""

    level: int = 0
    service_s: float = 0.0  # accelerator-seconds its turns ran (a batched turn counts its wall time)
    worker: str = ""  # where its last turn ran: its next one goes there if it can (the prefix cache)


class Trajectories:
    """Per job, its most recent trajectories (older ones are forgotten: a job may run millions)."""

    def __init__(self, mlfq: Mlfq, keep: int = 4096) -> None:
        self.mlfq = mlfq
        self.keep = keep
        self._by_job: dict[str, OrderedDict[str, Trajectory]] = {}

    def turn(self, job_id: str, trajectory: str, signals: TurnSignals) -> int:
        """A new turn of ``trajectory`` is submitted: its level (never above the last one's)."""
        known = self._by_job.setdefault(job_id, OrderedDict())
        traj = known.pop(trajectory, None) or Trajectory()
        known[trajectory] = traj
        while len(known) > self.keep:
            known.popitem(last=False)
        traj.level = max(traj.level, self.mlfq.level(signals, traj.service_s))
        return traj.level

    def get(self, job_id: str, trajectory: str) -> Trajectory | None:
        known = self._by_job.get(job_id)
        return known.get(trajectory) if known is not None else None

    def ran(self, job_id: str, trajectory: str, worker_id: str, seconds: float) -> None:
        traj = self.get(job_id, trajectory)
        if traj is not None:
            traj.service_s += seconds
            traj.worker = worker_id

    def forget(self, job_id: str) -> None:
        self._by_job.pop(job_id, None)
