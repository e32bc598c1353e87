"""Libra's bucket scheduler: the level of an agent's next turn, and the bucket and vLLM priority
that level gets, from what its trajectory has shown at its tool boundaries (a multi-level
feedback queue on causal signals, not length predictions).

A trajectory starts at level 0 and only moves down the queue (to higher levels) for each signal
seen at a tool boundary that says it will run long, measured against its job's other
trajectories at the same turn (its peers: what is long or error-prone depends on the task, so no
absolute threshold fits every job): its tokens since its prompt ``peer_ratios`` times or more
their mean (it has been writing longer turns: hard problems stay hard); every ``errors_per_level``
tool errors or retries beyond their mean (the agent will try again; all of them while fewer than
``peer_min`` peers were seen, or with ``peer_ratios`` empty: no comparison at all). Besides: its
tokens past ``budget_fraction`` of its token budget, and optionally every ``turns_per_level``
turns and the accelerator time its turns received crossing a ``service_s`` threshold (attained
service, as in Autellix; both off by default: an agent's turn count depends on its task, and
seconds on the hardware and the batch). Its level is computed when a turn is submitted, so a
trajectory changes buckets only between turns.

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

PEER_WINDOW = 256  # a job's means at a turn follow about its last this many trajectories (lengths drift)


@dataclass(frozen=True, slots=True)
class Mlfq:
    """The levels and what moves a trajectory down them."""

    levels: int = 4
    peer_ratios: tuple[float, ...] = (2.0, 4.0)  # tokens since its prompt over its peers' mean: a level at each
    peer_min: int = 8  # trajectories of the job seen at a turn before their means count
    errors_per_level: int = 1  # tool errors or retries beyond its peers' mean (or all, without peers) per level
    budget_fraction: float = 0.5  # tokens past this share of the budget: one level down
    turns_per_level: int = 0  # every this many turns taken: one level down (0: off)
    service_s: tuple[float, ...] = ()  # attained accelerator-seconds at which a level each starts (() : off)

    def level(self, signals: TurnSignals, service_s: float, peers: Peers | None = None, grown: float = 0.0) -> int:
        """The level of a turn with these ``signals`` after ``service_s`` of service and ``grown``
        tokens since its prompt, given its ``peers`` at this turn (None: too few seen yet)."""
        level = bisect.bisect_right(self.service_s, service_s)
        errors = float(signals.tool_errors + signals.retries)
        if peers is not None and signals.turn > 0 and self.peer_ratios:
            level += bisect.bisect_right(self.peer_ratios, grown / max(peers.grown, 1.0))
            errors -= peers.errors
        level += max(0, int(errors // max(1, self.errors_per_level)))
        if self.turns_per_level > 0:
            level += signals.turn // self.turns_per_level
        if signals.token_budget > 0 and signals.tokens >= self.budget_fraction * signals.token_budget:
            level += 1
        return min(self.levels - 1, level)


@dataclass(slots=True)
class Peers:
    """A job's trajectories at one turn: how many were seen, their mean tokens since their prompts
    and their mean tool errors and retries."""

    seen: int = 0
    grown: float = 0.0
    errors: float = 0.0

    def add(self, signals: TurnSignals, grown: float) -> None:
        self.seen += 1
        weight = 1.0 / min(self.seen, PEER_WINDOW)  # a running mean over about the last PEER_WINDOW
        self.grown += weight * (grown - self.grown)
        self.errors += weight * (signals.tool_errors + signals.retries - self.errors)


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
    prompt_tokens: int = 0  # its tokens at its first turn (0: its first turn was not seen here)


class Trajectories:
    """Per job, its most recent trajectories (older ones are forgotten: a job may run millions) and
    its trajectories at each turn (``Peers``)."""

    def __init__(self, mlfq: Mlfq, keep: int = 4096) -> None:
        self.mlfq = mlfq
        self.keep = keep
        self._by_job: dict[str, OrderedDict[str, Trajectory]] = {}
        self._peers: dict[str, dict[int, Peers]] = {}  # job -> turn -> its trajectories there

    def turn(self, job_id: str, trajectory: str, signals: TurnSignals) -> int:
        """A new turn of ``trajectory`` is submitted: its level (never above the last one's)."""
        known = self._by_job.setdefault(job_id, OrderedDict())
        traj = known.pop(trajectory, None) or Trajectory()
        known[trajectory] = traj
        while len(known) > self.keep:
            known.popitem(last=False)
        if signals.turn == 0:
            traj.prompt_tokens = signals.tokens
        grown = signals.tokens - traj.prompt_tokens
        peers = self._peers.setdefault(job_id, {}).setdefault(signals.turn, Peers())
        known_peers = peers if peers.seen >= self.mlfq.peer_min else None
        traj.level = max(traj.level, self.mlfq.level(signals, traj.service_s, known_peers, grown))
        peers.add(signals, grown)
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
        self._peers.pop(job_id, None)
