"""The scheduler's seam: the events the server (or the simulator) feeds it, the actions it returns.

Plain frozen records, no behaviour: ``Scheduler.handle(event, now) -> list[Action]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plexrl.errors import PlexError
from plexrl.names import CallKind, EngineState, Role, Tier
from plexrl.plan import JobShape, WorkerPlan

# -- events (server -> scheduler) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    worker_id: str
    slots: int = 1  # calls the worker may run at once
    memory_bytes: float = math.inf  # device memory jobs' state may use at most (--memory-budget)
    swap_bytes_per_s: float = 10e9  # host<->device bandwidth, until measured transfers refine it
    trainer_slots: int = 0  # of ``slots``, how many may be calls other than generate; 0 = all
    role: Role = "both"  # "rollout": pooled jobs' turns only, no job's home (Libra); "train": homes only
    bucket: int = 0  # a rollout worker's bucket: the lowest trajectory level it serves (coordinator/buckets.py)
    node: str = ""  # its host (NVLink domain): a multi-device job's group lies within one ("": a node of its own)
    index: int = 0  # its device index on ``node``: groups are aligned blocks of indices (coordinator/groups.py)
    # Its generates need no job's state on the device: its sampler keeps its own copy of every
    # job's weights (vLLM's adapters), so only trainer-lane calls wait for a move in.
    stateless_generates: bool = False
    devices: int = 1  # accelerators acting as one (a tensor-parallel sampler): what it adds to a stage's capacity
    # Its device and settings: the memory plan (plexrl/plan.py) then counts base models, engines and
    # activation headroom against its capacity. None: only ``memory_bytes`` bounds jobs' state.
    plan: WorkerPlan | None = None
    # The call kinds it runs beside its other calls (opens load bases and start engines, saves
    # write checkpoints: seconds to minutes): they take none of its ``trainer_slots``.
    background_calls: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """The worker serves ``role`` from now on (Libra's elastic roles): an operator's order, or the
    end of a ``MoveWorker`` (``seconds``: what the switch took, measured). Calls it runs finish
    where they are."""

    worker_id: str
    role: Role
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerLost:
    worker_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class GangBroken:
    """A gang job's call broke its process group (a member failed or timed out between
    collectives): its members' states may differ, so it is rebuilt as if a member were lost; the
    call runs again after."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class JobOpened:
    job_id: str
    state_bytes: int = 0  # what must be on the device for its calls to run
    weight: float = 1.0  # its share of accelerator time relative to other jobs (plex)
    base: str = ""  # its base model: plex places jobs on one base together (their generates batch)
    disaggregated: bool = False  # its generates run on a sampler worker other than its home
    pooled: bool = False  # its generates run on the rollout workers, each turn in its level's bucket
    devices: int = 1  # a worker group of this many (1, 2, 4, 8): ``state_bytes`` is then each member's shard
    # What it trains, sized before it is placed: a worker with a plan gets the plan's footprint
    # (``state_bytes`` from it, and the base and engines it holds there). None: sized by its open.
    shape: JobShape | None = None


@dataclass(frozen=True, slots=True)
class JobResumed:
    """A job a restarted coordinator read from its journal: its state exists on no worker, so it is
    placed like a recoverable job whose worker was lost (``Recover``, then a ``restore``)."""

    job_id: str
    state_bytes: int
    weight: float = 1.0
    base: str = ""


@dataclass(frozen=True, slots=True)
class JobSized:
    """The worker measured the job's state (known once its ``open`` ran); sent before that call's
    ``CallFinished``. State that outgrew the device's budget is moved out first thing."""

    job_id: str
    state_bytes: int
    # Its worker snapshots it (small enough): the scheduler makes it recoverable if it is colocated
    # (the server then keeps what rebuilds it elsewhere: a snapshot, the calls since).
    snapshots: bool = False


@dataclass(frozen=True, slots=True)
class JobClosed:
    job_id: str


@dataclass(frozen=True, slots=True)
class TurnSignals:
    """What an agent's trajectory showed up to the turn it submits (seen at its tool boundaries)."""

    turn: int = 0  # turns it already took
    tool_errors: int = 0  # tool calls that failed
    retries: int = 0  # tool calls it repeated
    tokens: int = 0  # tokens so far, sampled and observed
    token_budget: int = 0  # its budget (``max_tokens`` of the trajectory; 0: none)


@dataclass(frozen=True, slots=True)
class CallSubmitted:
    call_id: int  # increasing in submission order
    job_id: str
    kind: CallKind
    priority: int = 0  # generates: lower is admitted first (frontier groups)
    front: bool = False  # ahead of every unfinished call of the job (a ``restore``)
    trajectory: str = ""  # a generate that is a turn of this trajectory (pooled jobs route by it)
    signals: TurnSignals = TurnSignals()


@dataclass(frozen=True, slots=True)
class CallFinished:
    call_id: int
    error: str = ""  # why the worker failed it ("" = it succeeded); a failed open or restore ends its job


@dataclass(frozen=True, slots=True)
class CallCancelled:
    """The caller gave up: a queued call leaves its queue; a running one runs until the worker
    reports it (aborted or finished) with ``CallFinished``."""

    call_id: int


@dataclass(frozen=True, slots=True)
class SwapDone:
    """The worker finished moving ``job_id``'s state (the direction the ``Swap`` named)."""

    job_id: str
    seconds: float
    moved_bytes: int | None = None  # measured; None: the bytes the Swap named
    ok: bool = True  # False: the move failed and the state stayed where it was
    worker_id: str = ""  # the worker that moved it (a group job's state moves on each member: one each)


@dataclass(frozen=True, slots=True)
class EnginesMoved:
    """The worker finished the ``MoveEngines``: its vLLM engines are in the state it named
    (``ok``), or stayed awake (the sleep or wake failed)."""

    worker_id: str
    seconds: float
    ok: bool = True


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed with nothing else happening: re-check waiting jobs (the starvation bound)."""


@dataclass(frozen=True, slots=True)
class ReplicaFailed:
    """A rollout worker could not take a pooled job's replica or weights (``Replicate``): it gets
    them again before the job's next turn there (the turn sent behind them fails)."""

    worker_id: str
    job_id: str


Event = (
    WorkerJoined
    | WorkerRole
    | WorkerLost
    | GangBroken
    | JobOpened
    | JobResumed
    | JobSized
    | JobClosed
    | CallSubmitted
    | CallFinished
    | CallCancelled
    | SwapDone
    | EnginesMoved
    | ReplicaFailed
    | Tick
)

# -- actions (scheduler -> server) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    """The job's trainer state lives on ``worker_id`` for the job's life; its generates run on
    ``sampler_id`` (the same worker unless the job is disaggregated). ``worker_id`` "": no worker
    is registered yet; the job waits for one (a ``Recover`` places it, its ``open`` still queued),
    up to the scheduler's ``recovery_wait_s``."""

    job_id: str
    worker_id: str
    sampler_id: str = ""  # "" for a colocated job (its home)
    members: tuple[str, ...] = ()  # a group job's workers (``worker_id`` first, its leader); () for one device


@dataclass(frozen=True, slots=True)
class Recover:
    """The job's home was lost and the job lives on, on ``worker_id``: its state is rebuilt there
    by a ``restore`` call of the scheduler's own (``OwnCall``), queued ahead of its other calls when
    ``restore`` is set (it is not when one is already pending, or the job never finished opening).
    Its calls that were running there are queued again. ``worker_id`` "": no worker can take it
    now; it waits (up to the scheduler's ``recovery_wait_s``) for one to join, and then gets
    another ``Recover``."""

    job_id: str
    worker_id: str
    restore: bool = True
    members: tuple[str, ...] = ()  # a group job's new workers (``worker_id`` first)


@dataclass(frozen=True, slots=True)
class JobLost:
    """The job cannot go on (its state is gone with a worker, a restore failed, or no worker took
    it in time): its calls failed with ``error`` (a ``Fail`` each, sent before this), and every
    later one will. Its client closes it; a restarted coordinator forgets it."""

    job_id: str
    error: PlexError


@dataclass(frozen=True, slots=True)
class OwnCall:
    """A call the scheduler made, not a client (its id is negative): the server builds what it
    sends from its record of the job. ``restore``: rebuild the job on its new home from its
    snapshot and the calls since. With ``follows``, a disaggregated job's barrier's part on its
    sampler worker (``open``: a replica of its sampler; ``set_weights``: the weights the barrier
    exported; ``close``): the caller of ``follows`` hears once it is done. With ``join``, a restore
    on the members of a job whose training rollout workers joined (``scheduler/elastic.py``)."""

    job_id: str
    kind: CallKind
    follows: int = 0  # the call it carries on (0: none)
    join: bool = False  # a restore dispatched to a job rollout workers joined (not a recovery): ``Gangs._start``


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Run the call on ``worker_id``; a group job's call runs on all of its members at once (gang),
    ``worker_id`` being its leader."""

    call_id: int
    worker_id: str
    priority: int = 0  # for the worker's engine queue (vLLM): lower runs first
    # Sampling on the worker pauses while it runs (its turns are kept and go on after): a trainer
    # call on a worker taken back from rollout, whose leftover turns would slow the training that
    # the job's next rollout waits for.
    exclusive: bool = False
    own: OwnCall | None = None  # a call of the scheduler's own (None: a submitted one)


@dataclass(frozen=True, slots=True)
class Fail:
    """Fail the call (or, with ``call_id`` None, the job's opening) with ``error``."""

    job_id: str
    call_id: int | None
    error: PlexError


@dataclass(frozen=True, slots=True)
class Swap:
    """Move ``job_id``'s state on ``worker_id`` to ``to`` (``device`` or ``host``); answer with ``SwapDone``."""

    job_id: str
    worker_id: str
    to: Tier  # device or host
    state_bytes: int


@dataclass(frozen=True, slots=True)
class MoveEngines:
    """Put ``worker_id``'s vLLM engines to sleep at ``level`` (``to`` ``asleep``: its training needs
    their memory) or wake them (``awake``: a call samples or changes what they serve); answer with
    ``EnginesMoved``. Nothing that uses them runs there meanwhile."""

    worker_id: str
    to: EngineState  # asleep or awake
    level: int
    engine_bytes: int  # their reservations, by the plan
    job_id: str  # whose call asked for it (charged its seconds)


@dataclass(frozen=True, slots=True)
class MoveWorker:
    """Switch ``worker_id`` to ``role`` now, and answer with ``WorkerRole``. The rebalancer decided
    the move earlier; the scheduler gave the worker no new call of its old role since and sends
    this once it has drained (a worker bound for training: no turn runs there; for rollout: at
    once). Its homes' trainer calls run on throughout."""

    worker_id: str
    role: Role


@dataclass(frozen=True, slots=True)
class Replicate:
    """Sent just ahead of a pooled job's turn on a rollout worker: the worker gets a replica of the
    job's sampler (``open``) and the job's current weights (``weights``: it serves older ones, or
    the replica is new and the job has changed its weights since it opened). A worker runs what it
    receives in order, and a turn never passes a barrier, so the turn samples exactly those."""

    worker_id: str
    job_id: str
    open: bool
    weights: bool
    weight_bytes: int  # what a push of the weights carries (by the plan, or estimated from the state)


@dataclass(frozen=True, slots=True)
class Release:
    """Free what ``worker_id`` holds of ``job_id`` that nobody can use any more: a pooled job's
    replica, or the surviving half of a job lost with its other worker. Nobody waits for it."""

    worker_id: str
    job_id: str


Action = Place | Recover | Dispatch | Fail | JobLost | Swap | MoveEngines | MoveWorker | Replicate | Release
