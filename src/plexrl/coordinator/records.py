"""The coordinator's records of what its clients and workers told it: jobs' client facts, calls
in flight, peers; and the pure steps on them (a call's check, its commit, the calls built for
the scheduler's own). Where a job runs and whether it is closing, lost, pooled or
recoverable are the scheduler's (``scheduler.JobView``), not kept here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import msgspec

from plexrl.coordinator import events as ev
from plexrl.coordinator.events import OwnCall
from plexrl.coordinator.journal import JobRow, JournaledJob
from plexrl.coordinator.scheduler import JobView
from plexrl.errors import GangBrokenError, InvalidRequestError
from plexrl.names import JobStatus
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.protocol.liveness import Liveness

# Calls that change a job's state: the last one done is its commit point (journaled, and what a
# reattaching client hears); those that change what its sampler serves are also barriers.
STATEFUL = (calls.ForwardBackward, calls.OptimStep, calls.SyncWeights, calls.Load)
NEW_WEIGHTS = (calls.SyncWeights, calls.Load)


@dataclass
class WorkerRecord:
    ident: bytes
    worker_id: str
    info: m.Register
    liveness: Liveness
    calls_done: int = 0
    progress: int = 0  # its engine's progress count, from its heartbeats
    role_moves: int = 0
    joins: int = 0  # times it joined a job's training from rollout (elastic data parallelism)
    progress_at: float = 0.0  # when that count last moved, or the worker was last idle


@dataclass
class JobRecord:
    """A job's client facts: who owns it, what opened it, its commit point and recovery data. Where
    it runs, whether it is closing or lost, pooled or recoverable: the scheduler's (``JobView``)."""

    job_id: str
    name: str
    owner: str  # the tenant: its key (z85) with authentication, else the connection that opened it
    spec: calls.JobSpec
    calls_done: int = 0
    client: bytes = b""  # the connection it is attached to
    opened: calls.Opened | None = None  # what its opening returned (for a client that reattaches)
    suspended: bool = False  # its client went away: it waits for one to reattach
    suspended_at: float = 0.0
    open: calls.Open | None = None  # the call that opened it (a restore opens it again elsewhere)
    weight: float = 1.0
    next_seq: int = 1  # the number (``Submit.seq``) its next call gets unless its client numbers it
    generates: int = 0  # its generate calls so far (the seed index of the next)
    # Its commit point: its state holds its calls up to number ``committed_seq``, the last of
    # which returned ``committed``; ``weights_seq``: the last that changed what its sampler serves.
    committed_seq: int = 0
    committed: calls.Result | None = None
    weights_seq: int = 0
    token: str = ""  # its OpenJob's (a client that lost the reply to its opening finds it by this)
    # Recovery (a job the scheduler made recoverable): the snapshot of its last optim_step or load,
    # and its forward_backward / sync_weights calls since, in order; a restore on another worker
    # rebuilds it from these when its worker is lost.
    snapshot: calls.Snapshot | None = None
    replay: list[calls.ForwardBackward | calls.SyncWeights] = field(default_factory=list)
    recoveries: int = 0
    # A pooled job (its generates run on the rollout workers): the weights its sampler serves, as
    # its last sync_weights or load exported them (None: its initial ones), pushed to a rollout
    # worker before that worker's first turn of it under them.
    weights: calls.SetWeights | None = None
    gang_epoch: int = 0  # a gang job's: one more after each call that broke its process group


@dataclass(frozen=True)
class Peer:
    """A connection's tenant: its key with authentication (else the connection itself)."""

    tenant: str
    admin: bool = False  # sees every tenant's jobs in status


@dataclass
class CallRecord:
    call_id: int
    job_id: str
    client: bytes
    client_rid: int
    call: calls.Call
    # A disaggregated job's barrier's part on its sampler worker (``follow_on``): what it sends
    # there (``call`` stays the barrier), and what the barrier's caller hears once it is done.
    sent: calls.Call | None = None
    held: m.CallDone | None = None
    tenant: str = ""  # whose submitted call this is (counted against its limits)
    nbytes: int = 0  # its message's size
    seq: int = 0  # its number in its job's order (``Submit.seq``)
    submitted_at: float = 0.0  # when it was submitted (the coordinator's clock), for queue and run times
    dispatched_at: float = 0.0
    gang: GangWait | None = None  # a gang's call: its members' replies so far
    join: bool = False  # the restore that widens a job's training to rollout workers (``OwnCall.join``)


@dataclass
class GangWait:
    """A call sent to every member of a gang: it is done when all have answered; the leader's
    answer is the call's, unless a member failed: then a broken gang if one says so (its state
    is rebuilt), else the first failure, the leader's first."""

    members: tuple[str, ...]  # the leader first
    replies: dict[str, m.CallDone | m.ErrorReply] = field(default_factory=dict)

    def answer(self) -> m.CallDone | m.ErrorReply | None:
        """The call's answer once every member has given one (None: some have not yet)."""
        if len(self.replies) < len(self.members):
            return None
        failed = [r for w in self.members if isinstance(r := self.replies[w], m.ErrorReply)]
        broken = [r for r in failed if r.code == GangBrokenError.code]
        if broken or failed:
            return (broken or failed)[0]
        return self.replies[self.members[0]]


@dataclass
class StatusWaiter:
    client: bytes
    rid: int
    min_workers: int


@dataclass(frozen=True)
class ReattachWaiter:
    client: bytes
    rid: int
    tenant: str
    name: str
    job_id: str = ""  # that job of the name ("": whichever)

    def wants(self, job: JobRecord) -> bool:
        return (self.tenant, self.name) == (job.owner, job.name) and self.job_id in ("", job.job_id)


def status(job: JobRecord, view: JobView) -> JobStatus:
    """The job's status: the scheduler's facts first (lost, closing), then its client's lease."""
    return "lost" if view.lost else "closing" if view.closing else "suspended" if job.suspended else "open"


def journal_row(job: JobRecord) -> JobRow:
    """What the journal keeps of a recoverable job (its snapshot and replay go in rows of their own)."""
    assert job.open is not None and job.opened is not None
    return JobRow(
        job_id=job.job_id, name=job.name, owner=job.owner, weight=job.weight, open=job.open, opened=job.opened,
        committed_seq=job.committed_seq, committed=job.committed, weights_seq=job.weights_seq,
        next_seq=job.next_seq, recoveries=job.recoveries, token=job.token, generates=job.generates,
    )  # fmt: skip


def resumed(found: JournaledJob, now: float) -> JobRecord:
    """A job of a restarted coordinator's journal, suspended until its client reattaches."""
    row = found.row
    return JobRecord(
        row.job_id, row.name, row.owner, row.open.spec, suspended=True, suspended_at=now,
        opened=row.opened, open=row.open, weight=row.weight, next_seq=row.next_seq,
        committed_seq=row.committed_seq, committed=row.committed, weights_seq=row.weights_seq,
        snapshot=found.snapshot, replay=found.replay, recoveries=row.recoveries, token=row.token,
        generates=row.generates,
    )  # fmt: skip


@dataclass(frozen=True)
class Commit:
    """A call's commit (``commit``): the result its caller hears, and what a recoverable job's
    journal gets (a new snapshot, or a call to replay after it)."""

    result: calls.Result
    snapshot: calls.Snapshot | None = None
    replayed: calls.ForwardBackward | calls.SyncWeights | None = None


def commit(job: JobRecord, rec: CallRecord, result: calls.Result, recoverable: bool) -> Commit:
    """A call that changed ``job``'s state finished: it is the job's commit point. A recoverable
    job also keeps what rebuilds it elsewhere: the snapshot its optim_step or load returned (not
    passed on to the client), then each forward_backward and sync_weights done since."""
    call = rec.call
    if not isinstance(call, STATEFUL):
        return Commit(result)
    snapshot: calls.Snapshot | None = None
    replayed: calls.ForwardBackward | calls.SyncWeights | None = None
    if recoverable:
        match call, result:
            case (calls.OptimStep(), calls.OptimStepResult(snapshot=snapshot)) | (
                calls.Load(),
                calls.Loaded(snapshot=snapshot),
            ) if snapshot is not None:
                job.snapshot, job.replay = snapshot, []
                result = msgspec.structs.replace(result, snapshot=None)
            case calls.ForwardBackward(forward_only=True), _:
                pass  # changed nothing: nothing to replay
            case calls.ForwardBackward() | calls.SyncWeights(), _:
                job.replay.append(call)
                replayed = call
    job.committed_seq, job.committed = rec.seq, result
    if isinstance(call, NEW_WEIGHTS):
        job.weights_seq = rec.seq
    return Commit(result, snapshot, replayed)


def follow_on(job: JobRecord, rec: CallRecord, done: m.CallDone, call_id: int, own: OwnCall, now: float) -> CallRecord:
    """A disaggregated job's barrier ``rec``, done on its home (``done``), carried on by the
    scheduler's ``call_id`` on its sampler worker: a replica opened, the weights the barrier
    exported, or the replica closed. Its caller hears ``done`` once that is done."""
    assert job.open is not None and rec.call_id == own.follows, (rec.call_id, own)
    sent: calls.Call = calls.Close()
    held = done
    if own.kind == "open":
        sent = calls.Open(spec=job.spec, replica=True, tenant=job.open.tenant)
    elif own.kind == "set_weights":
        weights = weights_of(done.result)
        assert weights is not None, "a disaggregated job's sync_weights and load export its weights"
        sent = weights
        held = m.CallDone(rid=done.rid, job_id=done.job_id, result=without_weights(done.result))
    return dataclasses.replace(rec, call_id=call_id, sent=sent, held=held, submitted_at=now, dispatched_at=0.0)


def restore(job: JobRecord, call_id: int, export: bool, now: float, join: bool = False) -> CallRecord:
    """The scheduler's ``restore`` of ``job`` on a new home (``export``: a pooled job's, whose
    rollout workers fetch its weights from there from then on), or on the members of its widened
    gang (``join``): from its snapshot and the calls since."""
    assert job.open is not None
    call = calls.Restore(open=job.open, snapshot=job.snapshot, replay=list(job.replay), export=export)
    return CallRecord(call_id, job.job_id, b"", 0, call, submitted_at=now, join=join)


def replica_calls(job: JobRecord, open_replica: bool, weights: bool) -> list[calls.Call]:
    """What a rollout worker gets ahead of a pooled job's turn (``Replicate``)."""
    assert job.open is not None
    sent: list[calls.Call] = []
    if open_replica:
        sent.append(calls.Open(spec=job.spec, replica=True, tenant=job.open.tenant))
    if weights and job.weights is not None:
        sent.append(job.weights)
    return sent


def validate(call: calls.Call) -> None:
    """Reject bad calls here, before they take a place in a job's queue."""
    match call:
        case calls.Generate(prompts=prompts, params=params):
            params.validate()
            prompts.check("prompts")
        case calls.ForwardBackward(batch=batch, loss=loss):
            batch.validate(loss)
        case calls.Logprobs(tokens=tokens):
            tokens.check("tokens")
        case calls.Save(path=path) | calls.Load(path=path) if not path:
            raise InvalidRequestError("save/load need a non-empty path")
        case calls.Save(format=fmt) if fmt not in ("plexrl", "peft", "hf"):
            raise InvalidRequestError(f"save format {fmt!r}: choose plexrl (a checkpoint), peft or hf (exports)")


def signals(turn: m.TurnOf) -> ev.TurnSignals:
    return ev.TurnSignals(turn.turn, turn.tool_errors, turn.retries, turn.tokens, turn.token_budget)


def wire_bytes(n: float) -> int:
    """A byte count for the wire (an unbounded budget as 0: none)."""
    return 0 if math.isinf(n) else max(0, int(n))


def without_weights(result: calls.Result) -> calls.Result:
    """``result`` without the weights it exported (kept here for the job's other workers)."""
    if isinstance(result, calls.Opened):
        return msgspec.structs.replace(result, source=None)
    if isinstance(result, calls.Synced | calls.Loaded):
        return msgspec.structs.replace(result, tensors=None, source=None)
    return result


def weights_of(result: calls.Result) -> calls.SetWeights | None:
    """What gives a job's other workers the weights ``result`` exported (where they are published,
    or the tensors themselves when they go through the coordinator); None if it exported none."""
    match result:
        case calls.Synced(weight_version=v, tensors=t, source=src, exported_at=at) if t is not None or src:
            return calls.SetWeights(weight_version=v, tensors=t, source=src, exported_at=at)
        case calls.Loaded(weight_version=v, tensors=t, source=src) if t is not None or src:
            return calls.SetWeights(weight_version=v, tensors=t, source=src)
        case calls.Opened(source=src) if src is not None:
            return calls.SetWeights(weight_version=src.weight_version, source=src)
    return None
