"""Wire messages: one tagged union per direction between clients, the coordinator and workers.

Every message carries the protocol version ``v`` and a request id ``rid``. A reply reuses the
request's ``rid``; the coordinator's ``Execute`` uses its own call id as ``rid``, and the
worker's reply echoes it. Evolution rule (msgspec): new fields get defaults and go last.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from plexrl.names import JobStatus, Role, Tier
from plexrl.plan import JobShape, WorkerPlan
from plexrl.protocol.calls import Call, JobSpec, Opened, Result
from plexrl.trace import Span

PROTOCOL_VERSION = 1


class Envelope(msgspec.Struct, kw_only=True, tag_field="type", frozen=True):
    v: int = PROTOCOL_VERSION
    rid: int = 0


class Header(msgspec.Struct):
    """The part of every message that is read before the typed decode."""

    v: int
    rid: int = 0


# -- shared by several directions --------------------------------------------------------------


class Heartbeat(Envelope, tag="heartbeat", frozen=True):
    """Sent every interval by clients and workers; the coordinator answers each one.

    A worker heartbeats from a socket of its own (its call socket is busy while it computes)
    and names its call socket's identity in ``worker``; the coordinator answers a worker it does
    not know with ``Shutdown``, so a worker that was declared lost, or outlived a coordinator
    restart, registers again. ``progress`` is the worker engine's progress count: a worker whose
    count stands still while it runs a call is hung, not slow. A reply to a client says whether
    the coordinator knows that client (``known``): one that restarted, or declared the client
    gone, does not, and the client says Hello again and reattaches its jobs."""

    worker: bytes = b""
    progress: int = 0
    known: bool = True  # in a reply to a client: False if the coordinator does not know its connection


class CallDone(Envelope, tag="call_done", frozen=True):
    job_id: str
    result: Result
    compute_s: float = 0.0  # seconds the worker's engine spent on the call


class Shutdown(Envelope, tag="shutdown", frozen=True):
    """The coordinator is going away: fail what is pending now instead of waiting for heartbeats.
    To a worker: it is not (or no longer) registered; ``exit``: it was declared hung, so it exits
    (its engine is wedged: its supervisor starts a fresh one) instead of registering again."""

    reason: str
    exit: bool = False


class ErrorReply(Envelope, tag="error", frozen=True):
    code: str  # a plexrl.errors code
    message: str


# -- client -> coordinator ---------------------------------------------------------------------


class Hello(Envelope, tag="hello", frozen=True):
    client_name: str = ""


class OpenJob(Envelope, tag="open_job", frozen=True):
    """Create a job; answered by ``CallDone(result=Opened)`` naming the new job id."""

    name: str
    spec: JobSpec
    weight: float = 1.0  # the job's share of accelerator time relative to other jobs (plex policy)
    # or "disaggregated" (generates on another worker than training), or "pooled" (generates on
    # the rollout workers, each turn routed by its trajectory's signals; Libra)
    placement: str = "colocated"
    # The client's random name for this opening: after a coordinator restart it finds the job
    # (if the opening finished before the crash) with ``Reattach(token=)``, else opens it again.
    token: str = ""
    # What it trains, read from the model's config.json where the client can (``plexrl/plan.py``):
    # the coordinator places it by the memory plan, and refuses it if it fits no worker.
    shape: JobShape | None = None
    devices: int = 1  # workers it trains on at once (a gang; coordinator/groups.GROUP_SIZES)


class TurnOf(msgspec.Struct, frozen=True):
    """A generate that is a turn of an agent's trajectory, and what the trajectory showed so far
    at its tool boundaries: a pooled job's turns are routed by it (Libra's buckets)."""

    trajectory: str  # the trajectory's name, unique within its job
    turn: int = 0  # turns it already took
    tool_errors: int = 0  # tool calls that failed
    retries: int = 0  # tool calls it repeated
    tokens: int = 0  # its tokens so far, sampled and observed
    token_budget: int = 0  # its ``max_tokens`` (0: none)
    tool_s: float = 0.0  # what its tools took since its last turn, as the caller reported (a trace's tool span)


class Submit(Envelope, tag="submit", frozen=True):
    job_id: str
    call: Call
    priority: int = 0  # generates: lower is admitted first (a rollout's frontier groups)
    # The call's number in its job's order (1, 2, ...; the client's ``Job`` counts): a restarted
    # coordinator says up to which number its journal holds the job's calls. 0: the coordinator
    # numbers it.
    seq: int = 0
    turn: TurnOf | None = None  # a generate that is a trajectory's turn


class Cancel(Envelope, tag="cancel", frozen=True):
    """The client gave up on its request ``call_rid``: drop it if queued, abort it if running."""

    call_rid: int


class StatusRequest(Envelope, tag="status", frozen=True):
    min_workers: int = 0  # answer only once at least this many workers are registered


class TraceRequest(Envelope, tag="trace", frozen=True):
    """The calls the coordinator has kept a record of (the most recent ones), as spans."""


class Reattach(Envelope, tag="reattach", frozen=True):
    """Take over this tenant's job ``name`` whose client went away (answered ``Reattached``); if
    that client is not yet declared gone, the answer waits until it is. ``job_id``: that job of
    the name (a client taking its own jobs back after a coordinator restart)."""

    name: str
    job_id: str = ""
    token: str = ""  # the job its ``OpenJob`` with this token opened


# -- coordinator -> client ---------------------------------------------------------------------


class Reattached(Envelope, tag="reattached", frozen=True):
    job_id: str
    name: str
    spec: JobSpec
    opened: Opened
    # The job's commit point: its state holds its calls up to ``committed_seq`` (``Submit.seq``),
    # the last of which returned ``committed``; ``weights_seq``: its last call that changed what
    # its sampler serves. A client sends its unanswered calls after ``committed_seq`` again.
    committed_seq: int = 0
    committed: Result | None = None
    weights_seq: int = 0
    next_seq: int = 1  # the number its next call gets
    generates: int = 0  # its generate calls so far: the seed index of its next


class Welcome(Envelope, tag="welcome", frozen=True):
    client_id: str
    heartbeat_interval_s: float
    heartbeat_liveness: int


class WorkerInfo(msgspec.Struct, frozen=True):
    worker_id: str
    name: str
    device: str
    engines: list[str]
    memory_budget_bytes: int
    jobs: list[str]
    calls_done: int
    busy_s: float
    pid: int = 0
    state_bytes_on_device: int = 0  # jobs' state resident on its device (at most its budget)
    role: Role = "both"  # what it serves now (a train worker the coordinator lent to rollout says "rollout")
    bucket: int = 0
    role_moves: int = 0  # times the coordinator moved it between training and rollout
    joins: int = 0  # times it joined a job's training from rollout (elastic data parallelism)


class JobInfo(msgspec.Struct, frozen=True):
    job_id: str
    name: str
    owner: str
    worker_id: str
    queued: int
    running: bool
    calls_done: int
    state: JobStatus
    tier: Tier | Literal[""] = ""  # where its state is ("": nowhere yet, or another tenant's job)
    sampler_worker_id: str = ""  # a disaggregated job's sampler worker ("" = its worker_id)
    state_bytes: int = 0
    wall_s: float = 0.0  # since it opened
    accelerator_s: float = 0.0  # its calls' device time (its share when batched) + its transitions
    swaps: int = 0
    swap_bytes: int = 0
    swap_s: float = 0.0
    recoveries: int = 0  # times its worker was lost and the job rebuilt on another
    members: list[str] = []  # a job on several workers (a gang): them, its worker_id first

    @property
    def cost_vs_held(self) -> float:
        """Accelerator-seconds over wall seconds: what it pays here relative to holding a device
        for its whole life (1.0 = it used the device all the time)."""
        return self.accelerator_s / self.wall_s if self.wall_s > 0 else 0.0


class TraceReply(Envelope, tag="trace_reply", frozen=True):
    spans: list[Span]  # the asker's jobs' calls (an admin's: every job's), oldest first
    dropped: int = 0  # older calls no longer kept


class StatusReply(Envelope, tag="status_reply", frozen=True):
    workers: list[WorkerInfo]
    jobs: list[JobInfo]
    uptime_s: float


# -- worker -> coordinator ---------------------------------------------------------------------


class Register(Envelope, tag="register", frozen=True):
    name: str
    device: str
    engines: list[str]
    memory_budget_bytes: int
    pid: int
    slots: int = 1  # calls it runs at once (a vLLM sampler serves many jobs' generates together)
    trainer_slots: int = 0  # of those, calls other than generate (its trainer runs one at a time); 0 = slots
    role: str = "both"  # "rollout": pooled jobs' turns only; "train": jobs' homes only (coordinator/events.ROLES)
    bucket: int = 0  # a rollout worker's bucket: the lowest trajectory level it serves
    stateless_generates: bool = False  # its sampler keeps its own copy of jobs' weights (vLLM)
    plan: WorkerPlan | None = None  # its device's capacity and the settings the memory plan needs
    background_calls: list[str] = []  # call kinds it runs beside its other calls (in no trainer slot): open, save
    # Where it sits, for jobs on several workers (coordinator/groups.py): its host ("": it takes
    # one-device jobs only), its device index there, and its rendezvous store (host:port) for the
    # process groups of the gangs it leads (worker/gang.py).
    node: str = ""
    index: int = 0
    rendezvous: str = ""


class StateMoved(Envelope, tag="state_moved", frozen=True):
    """The answer to ``MoveState``: where the job's state is now, and what moving it cost."""

    job_id: str
    to: str
    bytes: int
    seconds: float
    error: str = ""  # the move failed (the state stayed where it was)


class EnginesMoved(Envelope, tag="engines_moved", frozen=True):
    """The answer to ``MoveEngines``: what the sleep or wake took."""

    to: str
    seconds: float
    error: str = ""  # it failed (the engines are taken to be awake)


# -- coordinator -> worker ---------------------------------------------------------------------


class Registered(Envelope, tag="registered", frozen=True):
    worker_id: str
    heartbeat_interval_s: float
    heartbeat_liveness: int


class GangCall(msgspec.Struct, frozen=True):
    """This member's part in a call of a job that runs on several workers (a gang): the call is
    sent to every member, and they meet over a process group (``worker/gang.py``)."""

    epoch: int  # the gang's generation: a new one (new members, a rebuild) gets a fresh group
    rank: int  # this member's; 0 is the leader, whose reply answers the call
    world: int  # members
    store: str  # host:port of the leader's rendezvous store
    token: str  # the job's gang name in that store (random: other gangs cannot collide)
    timeout_s: float = 120.0  # deadline of the rendezvous and of every collective


class Execute(Envelope, tag="execute", frozen=True):
    job_id: str
    call: Call
    priority: int = 0  # lower runs first where the engine queues requests (vLLM)
    exclusive: bool = False  # pause the worker's sampling while this call runs (its requests are kept)
    gang: GangCall | None = None  # set for a call of a job that runs on several workers


class MoveState(Envelope, tag="move_state", frozen=True):
    """Move the job's state to ``to`` (``device`` or ``host``); answered by ``StateMoved``."""

    job_id: str
    to: str


class MoveEngines(Envelope, tag="move_engines", frozen=True):
    """Put the worker's vLLM engines to sleep at ``level`` (``to`` ``asleep``) or wake them
    (``awake``); answered by ``EnginesMoved``. No call that uses them runs meanwhile."""

    to: str
    level: int = 1


class Abort(Envelope, tag="abort", frozen=True):
    """Stop the running call ``rid`` if the engine can (a vLLM generate); it then fails with
    ``CallAbortedError``. A call the engine cannot interrupt finishes as usual."""


# -- worker <-> worker (the data plane, worker/dataplane.py) -------------------------------------


class FetchWeights(Envelope, tag="fetch_weights", frozen=True):
    """Ask a worker for a job's published weights; answered by ``Weights`` or ``ErrorReply``."""

    job_id: str
    weight_version: int
    token: bytes  # from the WeightSource the coordinator passed on


class Weights(Envelope, tag="weights", frozen=True):
    tensors: dict[str, np.ndarray]


ClientToCoordinator = Hello | OpenJob | Submit | Cancel | StatusRequest | TraceRequest | Reattach | Heartbeat
CoordinatorToClient = Welcome | CallDone | ErrorReply | StatusReply | TraceReply | Reattached | Heartbeat | Shutdown
WorkerToCoordinator = Register | CallDone | ErrorReply | StateMoved | EnginesMoved | Heartbeat
CoordinatorToWorker = Registered | Execute | MoveState | MoveEngines | Abort | Heartbeat | Shutdown
WorkerToWorker = FetchWeights | Weights | ErrorReply
# The coordinator reads clients and workers on one ROUTER socket, so it decodes both unions.
ToCoordinator = (
    Hello
    | OpenJob
    | Submit
    | Cancel
    | StatusRequest
    | TraceRequest
    | Reattach
    | Heartbeat
    | Register
    | CallDone
    | ErrorReply
    | StateMoved
    | EnginesMoved
)
