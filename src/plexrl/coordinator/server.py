"""The coordinator process: one asyncio loop, one ROUTER socket, the scheduler behind one seam.

Clients and workers are DEALER peers of the same ROUTER. Each inbound message is decoded,
checked (ownership, job state, call validity) and turned into scheduler events; the actions the
scheduler returns are carried out here and nowhere else. The coordinator does no tensor math:
arrays in calls and results pass through as zero-copy frames.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from plexrl.coordinator import events as ev
from plexrl.coordinator import scheduler as sch
from plexrl.coordinator.buckets import Mlfq
from plexrl.coordinator.journal import JobRow, Journal
from plexrl.coordinator.metrics import Metrics
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.errors import (
    CallAbortedError,
    CoordinatorLostError,
    InvalidRequestError,
    JobClosedError,
    JobSuspendedError,
    NotAuthorizedError,
    NotJobOwnerError,
    PlexError,
    TooManyCallsError,
    UnknownClientError,
    UnknownJobError,
    WorkerLostError,
)
from plexrl.names import PLACEMENTS, ROLES, JobStatus, Role, is_role
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Codec, rid_of
from plexrl.protocol.liveness import Liveness
from plexrl.protocol.pump import Frames, Pump
from plexrl.trace import Span

log = logging.getLogger("plexrl.coordinator")

TICK_S = 0.1  # how often jobs waiting for device room are re-checked
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Calls whose engine work ticks the worker's progress (a decoding step, a row group's forward or
# backward, an optimizer step): one running with the count standing still means a hung engine.
# The others (open, save, load, ...) may load models or write files for long stretches: their
# deadlines bound them.
PROGRESSING = frozenset({"generate", "logprobs", "forward_backward", "optim_step"})
# Calls that change a job's state: the last one done is its commit point (journaled, and what a
# reattaching client hears); those that change what its sampler serves are also barriers.
STATEFUL = (calls.ForwardBackward, calls.OptimStep, calls.SyncWeights, calls.Load)
NEW_WEIGHTS = (calls.SyncWeights, calls.Load)
_WORKER_MESSAGES = (m.Register, m.CallDone, m.ErrorReply, m.StateMoved, m.EnginesMoved)
_CLIENT_MESSAGES = (m.Hello, m.OpenJob, m.Submit, m.Cancel, m.StatusRequest, m.TraceRequest, m.Reattach)
TRACE_SPANS = 100_000  # the most recent calls kept for `plexrl trace`


@dataclass
class _WorkerRecord:
    ident: bytes
    worker_id: str
    info: m.Register
    liveness: Liveness
    calls_done: int = 0
    progress: int = 0  # its engine's progress count, from its heartbeats
    moving: tuple[Role, float] | None = None  # a MoveWorker under way: (the role, since when)
    role_moves: int = 0
    progress_at: float = 0.0  # when that count last moved, or the worker was last idle


@dataclass
class _JobRecord:
    job_id: str
    name: str
    owner: str  # the tenant: its key (z85) with authentication, else the connection that opened it
    worker_id: str
    spec: calls.JobSpec
    sampler_id: str = ""  # a disaggregated job's sampler worker ("" = colocated)
    state: JobStatus = "open"  # "open" -> "closing" -> removed; "open" <-> "suspended" (its client gone); or "lost"
    calls_done: int = 0
    client: bytes = b""  # the connection it is attached to
    opened: calls.Opened | None = None  # what its opening returned (for a client that reattaches)
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
    # Recovery (a colocated job whose open reported snapshots): the snapshot of its last optim_step
    # or load, and its forward_backward / sync_weights calls since, in order; a restore on another
    # worker rebuilds it from these when its worker is lost.
    recoverable: bool = False
    snapshot: calls.Snapshot | None = None
    replay: list[calls.ForwardBackward | calls.SyncWeights] = field(default_factory=list)
    recoveries: int = 0
    # A pooled job (its generates run on the rollout workers): the weights its sampler serves, as
    # its last sync_weights or load exported them (None: its initial ones), pushed to a rollout
    # worker before that worker's first turn of it under them.
    pooled: bool = False
    weights: calls.SetWeights | None = None


@dataclass(frozen=True)
class _Peer:
    """A connection's tenant: its key with authentication (else the connection itself)."""

    tenant: str
    admin: bool = False  # sees every tenant's jobs in status


@dataclass
class _CallRecord:
    call_id: int
    job_id: str
    client: bytes
    client_rid: int
    call: calls.Call
    worker_id: str | None = None  # set on dispatch
    held: m.CallDone | None = None  # a disaggregated job's result, held while its sampler worker follows
    tenant: str = ""  # whose submitted call this is (counted against its limits)
    nbytes: int = 0  # its message's size
    seq: int = 0  # its number in its job's order (``Submit.seq``)
    submitted_at: float = field(default_factory=time.monotonic)  # for the metrics' queue and run times
    dispatched_at: float = 0.0


@dataclass
class _Waiter:
    client: bytes
    rid: int
    min_workers: int


@dataclass(frozen=True)
class _ReattachWaiter:
    client: bytes
    rid: int
    tenant: str
    name: str
    job_id: str = ""  # that job of the name ("": whichever)

    def wants(self, job: _JobRecord) -> bool:
        return (self.tenant, self.name) == (job.owner, job.name) and self.job_id in ("", job.job_id)


@dataclass
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:7400"
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 5  # a peer silent for this many intervals is dead
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    policy: str = "fifo"
    clock: Callable[[], float] = field(default=time.monotonic)
    # A key directory (``plexrl keys init``): CurveZMQ on the socket, peers checked against its
    # allowlists. None: unauthenticated, which only a loopback ``bind`` may be.
    keys: str | None = None
    # A client silent this long (a script's loop may block for a while: longer than a worker's
    # window) leaves its jobs suspended: queued calls dropped, running generates aborted ...
    client_timeout_s: float = 30.0
    # ... for this long, for ``client.reattach(name)``; then they are closed.
    client_grace_s: float = 300.0
    max_calls_per_tenant: int = 20_000  # submitted calls queued or running at once; more: TooManyCallsError
    max_bytes_per_tenant: int = 16 << 30  # and the bytes of their messages (batches, prompts)
    # Jobs whose state is at most this many bytes survive the loss of their worker (colocated jobs:
    # snapshots at every optim_step, kept here with the calls since); 0: none do.
    snapshot_max_bytes: int = 32 << 20
    recovery_wait_s: float = 300.0  # such a job waits this long for a worker that can take it, then fails
    # A worker running a call whose engine makes no progress this long is hung: declared lost.
    # Longer than any one step of work (a model load, one forward or backward); 0: never.
    hang_timeout_s: float = 600.0
    # A journal file (SQLite): jobs that survive the loss of their worker also survive a restart of
    # the coordinator (started again with the same journal). None: a restart loses every job.
    journal: str | None = None
    # Libra's elastic roles: a ``train`` worker whose pooled jobs are rolling out lends itself to
    # the rollout workers until one of them has training to do (``coordinator/rebalance.py``).
    elastic: bool = False
    move_prior_s: float = 1.0  # what a move is expected to cost before one is measured
    # Libra's buckets (``coordinator/buckets.py``): the ratios of a trajectory's tokens to its job's
    # other trajectories' at the same turn at which it moves a level down each, and the
    # accelerator-seconds of service at which it does (() : service counts for nothing).
    level_peer_ratios: tuple[float, ...] = Mlfq().peer_ratios
    level_service_s: tuple[float, ...] = Mlfq().service_s
    # A Prometheus endpoint (coordinator/metrics.py) on this port of the bind address's host; 0: a
    # free port (logged); None: none.
    metrics_port: int | None = None
    # How a disaggregated or pooled job's new weights reach its other workers: "workers", fetched
    # by them from its home worker's data plane (worker/dataplane.py); "coordinator", through
    # this process in the calls' messages (what bench/weights.py measures the data plane against).
    weights_via: str = "workers"


class Coordinator:
    """Serve until :meth:`stop`; ``address`` is the bound endpoint once ``serve`` has started."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.address = ""
        self._now = config.clock
        self._started = self._now()
        self._codec: Codec[m.ToCoordinator] = Codec(m.ToCoordinator, max_bytes=config.max_message_bytes)
        rebalancer = Rebalancer(prior_move_s=config.move_prior_s) if config.elastic else None
        self._scheduler = sch.Scheduler(
            config.policy,
            recovery_wait_s=config.recovery_wait_s,
            mlfq=Mlfq(peer_ratios=config.level_peer_ratios, service_s=config.level_service_s),
            rebalancer=rebalancer,
        )
        self._workers: dict[str, _WorkerRecord] = {}
        self._worker_by_ident: dict[bytes, str] = {}
        self._jobs: dict[str, _JobRecord] = {}
        self._calls: dict[int, _CallRecord] = {}
        self._call_of: dict[tuple[bytes, int], int] = {}  # (client, its request id) -> call id
        self._waiters: list[_Waiter] = []
        self._clients: dict[bytes, Liveness] = {}  # connected clients and their heartbeats
        self._reattach_waiters: list[_ReattachWaiter] = []
        self._calls_of_tenant: collections.Counter[str] = collections.Counter()
        self._bytes_of_tenant: collections.Counter[str] = collections.Counter()
        self._inbound_bytes = 0  # the size of the message being handled
        self._call_ids = itertools.count(1)
        self._worker_ids = itertools.count(0)
        self._job_ids = itertools.count(1)
        self._move_ids = itertools.count(1)
        # move id -> (worker, job) awaiting StateMoved, or EnginesMoved (the job its engines move for)
        self._moves: dict[int, tuple[str, str]] = {}
        # Rollout workers' replicas of pooled jobs: worker -> job -> the weight version it serves.
        self._replicas: dict[str, dict[str, int]] = collections.defaultdict(dict)
        self._replica_calls: dict[int, tuple[str, str]] = {}  # call id -> (worker, job) of a replica's open or weights
        self._unawaited: set[int] = set()  # closes of leftover state whose answers nobody waits for
        self._stopping = asyncio.Event()
        self._pump: Pump | None = None
        self._allowlist = None if config.keys is None else auth.Allowlist(config.keys)
        self._peers: dict[bytes, _Peer] = {}  # connection -> its tenant
        self._hung: set[bytes] = set()  # call sockets of workers declared hung (told to exit)
        self._journal = None if config.journal is None else Journal(config.journal)
        self._metrics = None if config.metrics_port is None else Metrics()
        # Finished calls as spans (the job's owner beside each), the most recent TRACE_SPANS.
        self._spans: collections.deque[tuple[str, Span]] = collections.deque(maxlen=TRACE_SPANS)
        self._spans_recorded = 0
        self._clock_zero = time.monotonic()
        self.metrics_address = ""  # http://host:port/metrics once serving
        if self._journal is not None:
            self._job_ids = itertools.count(max(1, self._journal.counter("next_job")))

    # -- lifecycle ------------------------------------------------------------------------------

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # Hard per-frame cap (the peer is disconnected above it); the soft limit below it gets a
        # typed error reply.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        authenticator = None
        if self.config.keys is None:
            auth.check_insecure_bind(self.config.bind)
        else:
            assert self._allowlist is not None
            authenticator = auth.start_authenticator(ctx, self._allowlist)
            auth.serve_curve(sock, auth.load_pair(f"{self.config.keys}/{auth.COORDINATOR}.key_secret"))
        sock.bind(re.sub(r":0$", ":*", self.config.bind))
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pump = Pump(sock, self._on_frames)
        log.info("coordinator listening on %s", self.address)
        if self._metrics is not None and self.config.metrics_port is not None:
            host = re.sub(r"^tcp://(.*):[^:]*$", r"\1", self.address).strip("[]")
            port = self._metrics.serve(host, self.config.metrics_port, self._admin_status, asyncio.get_running_loop())
            self.metrics_address = f"http://{host}:{port}/metrics"
            log.info("metrics on %s", self.metrics_address)
        self._resume_journaled()
        if on_ready is not None:
            on_ready(self.address)
        try:
            async with asyncio.TaskGroup() as tg:
                liveness = tg.create_task(self._liveness_loop())
                ticks = tg.create_task(self._tick_loop())
                await self._stopping.wait()
                liveness.cancel()
                ticks.cancel()
        finally:
            self._fail_everything()
            self._pump.close()
            if authenticator is not None:
                authenticator.stop()
            if self._journal is not None:
                self._journal.close()
            if self._metrics is not None:
                self._metrics.close()
            ctx.term()
            log.info("coordinator stopped")

    def stop(self) -> None:
        self._stopping.set()

    def _fail_everything(self) -> None:
        """Tell peers the coordinator is going. With a journal its clients are left waiting for the
        one that resumes their jobs (they reconnect within ``Client.reconnect_s``)."""
        for ident in self._worker_by_ident:
            self._send(ident, m.Shutdown(reason="the coordinator shut down"))
        if self._journal is not None:
            return
        err = CoordinatorLostError("the coordinator shut down before the call finished")
        for rec in list(self._calls.values()):
            self._reply_error(rec.client, rec.client_rid, err)
        self._calls.clear()
        self._call_of.clear()
        for ident in self._clients:
            self._send(ident, m.Shutdown(reason="the coordinator shut down"))

    def _resume_journaled(self) -> None:
        """Take back the jobs of the journal: each waits, suspended, for its client to reattach,
        and is rebuilt on a worker (a ``restore`` from its snapshot and the calls since) as soon
        as one can take it."""
        if self._journal is None:
            return
        now = self._now()
        for found in self._journal.jobs():
            row = found.row
            job = _JobRecord(
                row.job_id, row.name, row.owner, "", row.open.spec, state="suspended", suspended_at=now,
                opened=row.opened, open=row.open, weight=row.weight, next_seq=row.next_seq,
                committed_seq=row.committed_seq, committed=row.committed, weights_seq=row.weights_seq,
                recoverable=True, snapshot=found.snapshot, replay=found.replay, recoveries=row.recoveries, token=row.token,
                generates=row.generates,
            )  # fmt: skip
            self._jobs[job.job_id] = job
            log.warning("job %s resumed from the journal (its calls up to %d)", job.job_id, job.committed_seq)
            resumed = ev.JobResumed(job.job_id, row.opened.state_bytes, weight=row.weight, base=row.open.spec.model)
            self._apply(resumed)

    def _journal_row(self, job: _JobRecord) -> JobRow:
        assert job.open is not None and job.opened is not None
        return JobRow(
            job_id=job.job_id, name=job.name, owner=job.owner, weight=job.weight, open=job.open, opened=job.opened,
            committed_seq=job.committed_seq, committed=job.committed, weights_seq=job.weights_seq,
            next_seq=job.next_seq, recoveries=job.recoveries, token=job.token, generates=job.generates,
        )  # fmt: skip

    # -- loops ----------------------------------------------------------------------------------

    def _on_frames(self, frames: Frames) -> None:
        ident, body = frames[0].bytes, frames[1:]
        self._inbound_bytes = sum(len(f) for f in body)
        try:
            msg = self._codec.decode(body)
        except PlexError as e:
            log.warning("bad message from %s: %s", ident.hex(), e)
            self._reply_error(ident, rid_of(e), e)
            return
        try:
            self._identify(ident, frames[-1], msg)
            self._on_message(ident, msg)
        except PlexError as e:
            self._reply_error(ident, msg.rid, e)

    def _identify(self, ident: bytes, frame: zmq.Frame, msg: m.ToCoordinator) -> None:
        """Who sent ``msg`` (its tenant, for jobs and status); with keys, the message must suit the
        role of the key its connection authenticated with."""
        if self._allowlist is None:
            if ident not in self._peers:
                self._peers[ident] = _Peer(ident.hex(), admin=True)  # a connection is a tenant; no secrets
            return
        user = frame.get("User-Id")  # the key ZAP admitted the connection with (z85)
        role = self._allowlist.role(user if isinstance(user, str) else None)
        if isinstance(user, str) and role is not None and ident not in self._peers:
            self._peers[ident] = _Peer(user, admin=role == "admin")  # a connection keeps its key
        if isinstance(msg, _WORKER_MESSAGES) or (isinstance(msg, m.Heartbeat) and msg.worker):
            if role != "worker":
                raise NotAuthorizedError(
                    f"{type(msg).__name__} needs a worker key, and this connection's key is a {role} key: "
                    "start workers with a key from `plexrl keys add DIR NAME --role worker`"
                )
        elif isinstance(msg, _CLIENT_MESSAGES) and role not in ("client", "admin"):
            raise NotAuthorizedError(
                f"{type(msg).__name__} needs a client key, and this connection's key is a {role} key: "
                "connect with a key from `plexrl keys add DIR NAME --role client`"
            )

    async def _liveness_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            now = self._now()
            for rec in list(self._workers.values()):
                if not rec.liveness.tick():
                    self._lose_worker(rec, f"no heartbeat for {rec.liveness.liveness} intervals of {interval} s")
                elif not self._scheduler.running_on(rec.worker_id) & PROGRESSING:
                    rec.progress_at = now  # idle (or loading, saving, ...) is not hung
                elif 0 < self.config.hang_timeout_s <= now - rec.progress_at:
                    stalled = f"its engine made no progress for {now - rec.progress_at:.0f} s while running a call"
                    self._lose_worker(rec, f"hung: {stalled}")
                    self._hung.add(rec.ident)
                    self._send(rec.ident, m.Shutdown(reason=f"declared hung: {stalled}", exit=True))
            for ident, live in list(self._clients.items()):
                if not live.tick():
                    self._lose_client(ident)
            grace = self.config.client_grace_s
            for job in [j for j in self._jobs.values() if j.state == "suspended"]:
                if self._now() - job.suspended_at >= grace:
                    self._free(job, f"its client went away and did not reattach within {grace:g} s")

    async def _tick_loop(self) -> None:
        """Time passing matters to jobs waiting for device room (their starvation bound)."""
        while True:
            await asyncio.sleep(TICK_S)
            if self._scheduler.has_waiting():
                self._apply(ev.Tick())

    # -- inbound --------------------------------------------------------------------------------

    def _on_message(self, ident: bytes, msg: m.ToCoordinator) -> None:
        log.debug("%s from %s (rid %d)", type(msg).__name__, ident.hex(), msg.rid)
        worker_id = self._worker_by_ident.get(ident)
        if worker_id is not None:
            self._workers[worker_id].liveness.heard()
        elif ident in self._clients:
            self._clients[ident].heard()
        match msg:
            case m.Heartbeat(rid=rid, worker=call_ident) if call_ident:
                known = self._worker_by_ident.get(call_ident)
                if known is None:
                    hung = call_ident in self._hung
                    reason = "declared hung" if hung else "this worker is not registered here"
                    self._send(ident, m.Shutdown(rid=rid, reason=reason, exit=hung))
                else:
                    rec = self._workers[known]
                    rec.liveness.heard()
                    if msg.progress != rec.progress:
                        rec.progress, rec.progress_at = msg.progress, self._now()
                    self._send(ident, m.Heartbeat(rid=rid))
            case m.Heartbeat(rid=rid):
                self._send(ident, m.Heartbeat(rid=rid, known=ident in self._clients))
            case m.OpenJob() | m.Submit() | m.Cancel() | m.StatusRequest() | m.TraceRequest() | m.Reattach() if (
                ident not in self._clients
            ):
                raise UnknownClientError(
                    "this connection has not said Hello to this coordinator (it restarted, or declared your "
                    "client gone): say Hello, then reattach your jobs (plexrl's client does both by itself)"
                )
            case m.Hello(rid=rid):
                beats = max(1, math.ceil(self.config.client_timeout_s / self.config.heartbeat_interval_s))
                self._clients[ident] = Liveness(beats)
                interval, liveness = self.config.heartbeat_interval_s, self.config.heartbeat_liveness
                self._send(
                    ident,
                    m.Welcome(
                        rid=rid, client_id=ident.hex(), heartbeat_interval_s=interval, heartbeat_liveness=liveness
                    ),
                )
            case m.Register():
                self._register_worker(ident, msg)
            case m.OpenJob():
                self._open_job(ident, msg)
            case m.Submit():
                self._submit(ident, msg)
            case m.Cancel(call_rid=call_rid):
                self._cancel(ident, call_rid)
            case m.TraceRequest(rid=rid):
                self._send(ident, self._trace(rid, self._peers[ident]))
            case m.StatusRequest(rid=rid, min_workers=n):
                if len(self._workers) >= n:
                    self._send(ident, self._status(rid, self._peers[ident]))
                else:
                    self._waiters.append(_Waiter(ident, rid, n))
            case m.Reattach(rid=rid, name=name, job_id=job_id, token=token):
                self._reattach(ident, rid, name, job_id, token)
            case m.StateMoved():
                self._on_state_moved(worker_id, msg)
            case m.EnginesMoved():
                self._on_engines_moved(worker_id, msg)
            case m.CallDone() | m.ErrorReply():
                if worker_id is None:
                    log.warning(
                        "dropping %s from %s, which is not a registered worker", type(msg).__name__, ident.hex()
                    )
                    return
                self._on_call_outcome(worker_id, msg)

    def _register_worker(self, ident: bytes, msg: m.Register) -> None:
        if not is_role(msg.role) or msg.bucket < 0:
            raise InvalidRequestError(
                f"worker role {msg.role!r} / bucket {msg.bucket}: the role is one of {', '.join(ROLES)}, "
                "the bucket a level >= 0"
            )
        old = self._worker_by_ident.get(ident)
        if old is not None:  # a worker that lost us and came back: its old state is gone
            self._lose_worker(self._workers[old], "worker re-registered")
        worker_id = f"w{next(self._worker_ids)}"
        self._workers[worker_id] = _WorkerRecord(
            ident, worker_id, msg, Liveness(self.config.heartbeat_liveness), progress_at=self._now()
        )
        self._worker_by_ident[ident] = worker_id
        log.info("worker %s registered: %s on %s (pid %d, role %s)", worker_id, msg.name, msg.device, msg.pid, msg.role)
        interval, liveness = self.config.heartbeat_interval_s, self.config.heartbeat_liveness
        self._send(
            ident,
            m.Registered(rid=msg.rid, worker_id=worker_id, heartbeat_interval_s=interval, heartbeat_liveness=liveness),
        )
        joined = ev.WorkerJoined(
            worker_id, msg.slots, memory_bytes=msg.memory_budget_bytes or math.inf, trainer_slots=msg.trainer_slots,
            role=msg.role, bucket=msg.bucket, stateless_generates=msg.stateless_generates, plan=msg.plan,
            background_calls=tuple(msg.background_calls),
        )  # fmt: skip
        self._apply(joined)
        for w in [w for w in self._waiters if len(self._workers) >= w.min_workers]:
            self._waiters.remove(w)
            self._send(w.client, self._status(w.rid, self._peers[w.client]))

    def _open_job(self, ident: bytes, msg: m.OpenJob) -> None:
        if not _JOB_NAME.match(msg.name):
            raise InvalidRequestError(
                f"job name {msg.name!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        if not msg.weight > 0:
            raise InvalidRequestError(f"job weight {msg.weight} must be > 0 (1.0 is an equal share)")
        if msg.placement not in PLACEMENTS:
            raise InvalidRequestError(f"placement {msg.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        number = next(self._job_ids)
        job_id = f"{msg.name}-{number}"
        if self._journal is not None:  # a restarted coordinator never reuses a job id
            self._journal.set_counter("next_job", number + 1)
        call_id = next(self._call_ids)
        disaggregated = msg.placement == "disaggregated"
        snapshot_max_bytes = 0 if disaggregated else self.config.snapshot_max_bytes  # see Recover
        open_call = calls.Open(spec=msg.spec, tenant=self._tenant_folder(ident), snapshot_max_bytes=snapshot_max_bytes)
        self._calls[call_id] = _CallRecord(call_id, job_id, ident, msg.rid, open_call)
        # Its state's size is known once the worker opened it (JobSized).
        pooled = msg.placement == "pooled"
        opened = ev.JobOpened(
            job_id, weight=msg.weight, base=msg.spec.model, disaggregated=disaggregated, pooled=pooled, shape=msg.shape
        )
        for action in self._scheduler.handle(opened, self._now()):
            if isinstance(action, ev.Place):
                self._jobs[job_id] = _JobRecord(
                    job_id, msg.name, self._peers[ident].tenant, action.worker_id, msg.spec,
                    sampler_id=action.sampler_id, client=ident, open=open_call, weight=msg.weight, token=msg.token,
                    pooled=pooled,
                )  # fmt: skip
                self._apply(ev.CallSubmitted(call_id, job_id, "open"))
            elif isinstance(action, ev.Fail) and action.call_id is None:  # the opening itself failed
                self._carry_out(ev.Fail(job_id, call_id, action.error))
            else:
                self._carry_out(action)

    def _submit(self, ident: bytes, msg: m.Submit) -> None:
        job = self._jobs.get(msg.job_id)
        if job is None:
            raise UnknownJobError(f"no job {msg.job_id!r} on this coordinator: open one with plexrl.job(...) first")
        if job.owner != self._peers[ident].tenant:
            raise NotJobOwnerError(f"job {msg.job_id!r} belongs to another tenant; a client may only use its own jobs")
        if job.state == "closing":
            raise JobClosedError(f"job {msg.job_id!r} is closed: open a new job to keep going")
        if job.state == "suspended":
            raise JobSuspendedError(
                f"job {msg.job_id!r} lost its client and is suspended: take it over with client.reattach({job.name!r})"
            )
        if isinstance(msg.call, calls.Open | calls.SetWeights | calls.Restore):
            raise InvalidRequestError(
                f"{type(msg.call).__name__} calls are the coordinator's own: open jobs with OpenJob"
            )
        if msg.turn is not None and not isinstance(msg.call, calls.Generate):
            raise InvalidRequestError(f"only a generate can be a trajectory's turn, not {type(msg.call).__name__}")
        _validate(msg.call)
        if job.state == "lost" and isinstance(msg.call, calls.Close):
            self._drop_lost(job)
            self._send(ident, m.CallDone(rid=msg.rid, job_id=job.job_id, result=calls.Closed()))
            return
        if isinstance(msg.call, calls.Close) and job.state == "open" and not job.worker_id:
            # It waits for a worker to be rebuilt on: its state exists nowhere, so closing frees nothing.
            self._remove_job(job.job_id)
            self._send(ident, m.CallDone(rid=msg.rid, job_id=job.job_id, result=calls.Closed()))
            return
        if job.state == "lost":
            raise WorkerLostError(f"job {msg.job_id!r} lost its worker; open it again and load its last checkpoint")
        tenant, nbytes = self._peers[ident].tenant, self._inbound_bytes
        if not isinstance(msg.call, calls.Close):
            limit, byte_limit = self.config.max_calls_per_tenant, self.config.max_bytes_per_tenant
            if self._calls_of_tenant[tenant] >= limit:
                raise TooManyCallsError(
                    f"{limit} of your calls are queued or running (the coordinator's --max-calls-per-tenant): "
                    "await some before submitting more"
                )
            if self._bytes_of_tenant[tenant] + nbytes > byte_limit:
                raise TooManyCallsError(
                    f"your queued and running calls hold {self._bytes_of_tenant[tenant]} bytes and this one "
                    f"{nbytes}, over the coordinator's --max-bytes-per-tenant {byte_limit}: await some first"
                )
        if isinstance(msg.call, calls.Close):
            job.state = "closing"
        call, seq = msg.call, msg.seq or job.next_seq
        job.next_seq = max(job.next_seq, seq + 1)
        if isinstance(call, calls.Generate):
            if call.params.seed is None:  # the client's Job seeds its generates; a raw Submit may not
                seed = calls.generate_seed(job.spec.seed, job.generates)  # so a retry elsewhere samples the same
                call = msgspec.structs.replace(call, params=msgspec.structs.replace(call.params, seed=seed))
            job.generates += 1
        call_id = next(self._call_ids)
        self._calls[call_id] = _CallRecord(
            call_id, job.job_id, ident, msg.rid, call, tenant=tenant, nbytes=nbytes, seq=seq
        )
        self._calls_of_tenant[tenant] += 1
        self._bytes_of_tenant[tenant] += nbytes
        self._call_of[(ident, msg.rid)] = call_id
        if msg.turn is not None and msg.turn.tool_s > 0:  # the tools the trajectory waited on before this turn
            now = time.monotonic() - self._clock_zero
            self._record(job.owner, Span("", job.job_id, "tool", now - msg.turn.tool_s, now))
        turn = msg.turn if job.pooled else None  # other jobs' generates run where their job's sampler is
        trajectory, signals = ("", ev.TurnSignals()) if turn is None else (turn.trajectory, _signals(turn))
        kind = calls.CALL_KIND[type(msg.call)]
        self._apply(ev.CallSubmitted(call_id, job.job_id, kind, msg.priority, trajectory=trajectory, signals=signals))

    def _cancel(self, ident: bytes, call_rid: int) -> None:
        """A queued call is dropped; a running one is aborted on its worker (if the engine can)."""
        call_id = self._call_of.get((ident, call_rid))
        rec = self._calls.get(call_id) if call_id is not None else None
        if rec is None or isinstance(rec.call, (calls.Open, calls.Close)):
            return  # finished already, or not something to cancel
        if rec.worker_id is None:
            self._forget(rec)
            self._apply(ev.CallCancelled(rec.call_id))
            self._reply_error(rec.client, rec.client_rid, CallAbortedError("the call was cancelled before it ran"))
        else:
            self._send(self._workers[rec.worker_id].ident, m.Abort(rid=rec.call_id))

    # -- client leases ---------------------------------------------------------------------------

    def _lose_client(self, ident: bytes) -> None:
        """A client silent for the liveness window: its calls are cancelled, its jobs suspended."""
        del self._clients[ident]
        self._peers.pop(ident, None)
        self._waiters = [w for w in self._waiters if w.client != ident]
        self._reattach_waiters = [w for w in self._reattach_waiters if w.client != ident]
        for rec in [r for r in self._calls.values() if r.client == ident]:
            self._cancel(ident, rec.client_rid)
        for job in [j for j in self._jobs.values() if j.client == ident and j.state == "open"]:
            job.state, job.suspended_at = "suspended", self._now()
            log.warning("job %s suspended: its client went silent (grace %g s)", job.job_id, self.config.client_grace_s)
            if self.config.client_grace_s <= 0:
                self._free(job, "its client went away (no grace period)")
            else:
                self._serve_reattach(job)
        for job in [j for j in self._jobs.values() if j.client == ident and j.state == "lost"]:
            self._free(job, "its client went away")

    def _reattach(self, ident: bytes, rid: int, name: str, job_id: str, token: str) -> None:
        tenant = self._peers[ident].tenant
        mine = [
            j for j in self._jobs.values()
            if j.owner == tenant and j.name == name and job_id in ("", j.job_id) and token in ("", j.token)
        ]  # fmt: skip
        suspended = [j for j in mine if j.state == "suspended"]
        if suspended:
            job = max(suspended, key=lambda j: j.suspended_at)
            self._reattach_waiters.append(_ReattachWaiter(ident, rid, tenant, name, job.job_id))
            self._serve_reattach(job)
        elif any(j.state == "open" and j.client != ident for j in mine):
            self._reattach_waiters.append(_ReattachWaiter(ident, rid, tenant, name, job_id))  # once its client is gone
        else:
            raise UnknownJobError(
                f"no job named {name!r}{f' ({job_id})' if job_id else ''} of yours is open or suspended here "
                "(a coordinator restarted without --journal forgets its jobs): open it with plexrl.job"
            )

    def _serve_reattach(self, job: _JobRecord) -> None:
        """Hand a suspended job to a client waiting to reattach it, once the calls of its old
        client have finished (they may still change its state, and the commit point the new
        client hears must count them)."""
        if job.state != "suspended" or any(r.job_id == job.job_id and r.client for r in self._calls.values()):
            return
        waiter = next((w for w in self._reattach_waiters if w.wants(job)), None)
        if waiter is not None:
            self._reattach_waiters.remove(waiter)
            self._attach(job, waiter.client, waiter.rid)

    def _attach(self, job: _JobRecord, ident: bytes, rid: int) -> None:
        if job.opened is None:  # it never finished opening
            self._free(job, "its client went away while it was opening")
            self._reply_error(ident, rid, UnknownJobError(f"job {job.name!r} was still opening when its client left"))
            return
        job.state, job.client = "open", ident
        log.info("job %s reattached", job.job_id)
        attached = m.Reattached(
            rid=rid, job_id=job.job_id, name=job.name, spec=job.spec, opened=job.opened,
            committed_seq=job.committed_seq, committed=job.committed, weights_seq=job.weights_seq,
            next_seq=job.next_seq, generates=job.generates,
        )  # fmt: skip
        self._send(ident, attached)

    def _free(self, job: _JobRecord, reason: str) -> None:
        """Close a job no client holds (its replies go nowhere)."""
        log.warning("closing job %s: %s", job.job_id, reason)
        for waiter in [w for w in self._reattach_waiters if w.wants(job)]:
            self._reattach_waiters.remove(waiter)
            self._reply_error(waiter.client, waiter.rid, UnknownJobError(f"job {job.name!r} was closed: {reason}"))
        if job.state == "lost":
            self._drop_lost(job)
            return
        job.state, job.client = "closing", b""
        call_id = next(self._call_ids)
        self._calls[call_id] = _CallRecord(call_id, job.job_id, b"", 0, calls.Close())
        self._apply(ev.CallSubmitted(call_id, job.job_id, "close"))

    def _drop_lost(self, job: _JobRecord) -> None:
        """Forget a job that lost its worker: nothing left to free, but a disaggregated job's
        surviving worker still holds its half (freed, unawaited)."""
        for survivor in (job.worker_id, job.sampler_id):
            if survivor in self._workers:
                self._close_unawaited(survivor, job.job_id)
        self._remove_job(job.job_id)

    def _on_call_outcome(self, worker_id: str, msg: m.CallDone | m.ErrorReply) -> None:
        if msg.rid in self._replica_calls:
            self._replica_call_done(worker_id, msg)
            return
        if msg.rid in self._unawaited:
            self._unawaited.discard(msg.rid)
            log.debug("worker %s closed a job's leftover state (call %d): %s", worker_id, msg.rid, type(msg).__name__)
            return
        rec = self._calls.get(msg.rid)
        if rec is None or rec.worker_id != worker_id:
            log.warning("dropping outcome of unknown call %d from worker %s", msg.rid, worker_id)
            return
        self._workers[worker_id].calls_done += 1
        if isinstance(msg, m.CallDone) and self._follow_on_sampler(rec, msg):
            return  # the sampler worker does its part next; the caller hears once it is done
        self._forget(rec)
        job = self._jobs.get(rec.job_id)
        if job is not None:
            job.calls_done += 1
        if isinstance(msg, m.CallDone):
            result = rec.held.result if rec.held is not None else msg.result  # the home worker's
            if isinstance(result, calls.Synced) and isinstance(msg.result, calls.Synced) and msg.result.push_s:
                result = msgspec.structs.replace(result, push_s=msg.result.push_s)  # the sampler worker timed it
            if job is not None and job.pooled:
                result = self._keep_weights(job, result)
            if isinstance(result, calls.Opened):
                recoverable = result.snapshots and job is not None and not job.sampler_id
                self._apply(ev.JobSized(rec.job_id, result.state_bytes, recoverable=recoverable))
                if job is not None and isinstance(rec.call, calls.Open):
                    job.opened, job.recoverable = result, recoverable
                    if recoverable and self._journal is not None:  # before its client hears
                        self._journal.opened(self._journal_row(job))
            if job is not None:
                result = self._commit(job, rec, result)
            if rec.client:  # not the coordinator's own call (a restore, a close nobody awaits)
                done = m.CallDone(rid=rec.client_rid, job_id=rec.job_id, result=result, compute_s=msg.compute_s)
                self._send(rec.client, done)
        elif rec.client:
            self._send(rec.client, m.ErrorReply(rid=rec.client_rid, code=msg.code, message=msg.message))
        error = msg.message if isinstance(msg, m.ErrorReply) else ""
        if rec.dispatched_at:
            self._record_span(worker_id, rec, bool(error), job.owner if job is not None else "")
        self._apply(ev.CallFinished(rec.call_id, error=error))  # a failed open or restore fails the job's calls
        self._settle_move(worker_id)
        if isinstance(rec.call, calls.Restore) and job is not None:
            if error:
                self._mark_lost(job)
            else:
                job.recoveries += 1
                log.warning("job %s recovered on worker %s (recovery %d)", job.job_id, worker_id, job.recoveries)
        opening_failed = isinstance(rec.call, calls.Open) and isinstance(msg, m.ErrorReply)
        if opening_failed and rec.held is not None and job is not None and job.worker_id in self._workers:
            self._close_unawaited(job.worker_id, rec.job_id)  # the replica failed after the home opened
        if isinstance(rec.call, calls.Close) or opening_failed:
            self._remove_job(rec.job_id)
        elif job is not None:
            self._serve_reattach(job)

    def _commit(self, job: _JobRecord, rec: _CallRecord, result: calls.Result) -> calls.Result:
        """A call that changed ``job``'s state finished: it is the job's commit point. A recoverable
        job also keeps what rebuilds it elsewhere: the snapshot its optim_step or load returned
        (not passed on to the client), then each forward_backward and sync_weights done since;
        all of it journaled before the client hears. Returns the result for the client."""
        call = rec.call
        if not isinstance(call, STATEFUL):
            return result
        snapshot: calls.Snapshot | None = None
        replayed: calls.ForwardBackward | calls.SyncWeights | None = None
        if job.recoverable:
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
        if job.recoverable and self._journal is not None:
            self._journal.committed(self._journal_row(job), snapshot=snapshot, replayed=replayed, n=len(job.replay))
        return result

    def _remove_job(self, job_id: str) -> None:
        """Forget a job (closed, never opened, or lost and let go): here, in the journal, and in
        the scheduler (whose leftover calls of it fail)."""
        self._jobs.pop(job_id, None)
        if self._journal is not None:
            self._journal.closed(job_id)
        for worker_id, replicas in self._replicas.items():  # a pooled job's replicas on rollout workers
            if replicas.pop(job_id, None) is not None and worker_id in self._workers:
                self._close_unawaited(worker_id, job_id)
        self._apply(ev.JobClosed(job_id))

    def _mark_lost(self, job: _JobRecord) -> None:
        """The job's state is gone: its calls fail until its client closes it; a restart forgets it."""
        job.state = "lost"
        if self._journal is not None:
            self._journal.closed(job.job_id)

    def _follow_on_sampler(self, rec: _CallRecord, done: m.CallDone) -> bool:
        """A disaggregated job's barrier call, done on its home worker, continues on its sampler
        worker: open the replica, push the new (or loaded) weights, close the replica. True if it
        went on."""
        job = self._jobs.get(rec.job_id)
        if job is None or not job.sampler_id or rec.held is not None or rec.worker_id == job.sampler_id:
            return False
        follow: calls.Call
        match rec.call, done.result:
            case calls.Open(spec=spec, tenant=tenant), calls.Opened():
                follow, held = calls.Open(spec=spec, replica=True, tenant=tenant), done
            case calls.SyncWeights() | calls.Load(), calls.Synced() | calls.Loaded() if weights := _weights_of(
                done.result
            ):
                follow = weights
                result = msgspec.structs.replace(done.result, tensors=None, source=None)
                held = m.CallDone(rid=done.rid, job_id=done.job_id, result=result)
            case calls.Close(), _:
                follow, held = calls.Close(), done
            case _:
                return False
        sampler = self._workers.get(job.sampler_id)
        if sampler is None:
            return False  # lost: the scheduler fails the call with the worker
        rec.held, rec.worker_id = held, job.sampler_id
        self._send(sampler.ident, m.Execute(rid=rec.call_id, job_id=rec.job_id, call=follow))
        return True

    def _replicate(self, job: _JobRecord, worker_id: str) -> None:
        """Before a pooled job's turn goes to a rollout worker: the worker gets a replica of the
        job's sampler if it has none, and the job's current weights if it serves older ones. The
        worker runs the calls it receives in order, so the turn (sent next) runs on them; a turn
        is never dispatched across a sync (a barrier), so the version it samples is exact."""
        replicas = self._replicas[worker_id]
        ident = self._workers[worker_id].ident
        if job.job_id not in replicas:
            assert job.open is not None
            call_id = next(self._call_ids)
            self._replica_calls[call_id] = (worker_id, job.job_id)
            replica = calls.Open(spec=job.spec, replica=True, tenant=job.open.tenant)
            self._send(ident, m.Execute(rid=call_id, job_id=job.job_id, call=replica))
            replicas[job.job_id] = 0
        if job.weights is not None and replicas[job.job_id] != job.weights.weight_version:
            call_id = next(self._call_ids)
            self._replica_calls[call_id] = (worker_id, job.job_id)
            self._send(ident, m.Execute(rid=call_id, job_id=job.job_id, call=job.weights))
            replicas[job.job_id] = job.weights.weight_version

    def _replica_call_done(self, worker_id: str, msg: m.CallDone | m.ErrorReply) -> None:
        """A replica's open or new weights finished on a rollout worker. If it failed, the worker is
        sent them again before the job's next turn there (the turn sent behind it fails with the
        worker's error, which its caller hears)."""
        replica_of = self._replica_calls.pop(msg.rid)
        if isinstance(msg, m.ErrorReply):
            log.error("worker %s could not take job %s's replica or weights: %s", worker_id, replica_of[1], msg.message)
            self._replicas[worker_id].pop(replica_of[1], None)
            if replica_of[1] not in self._jobs:
                return
            self._close_unawaited(worker_id, replica_of[1])

    def _keep_weights(self, job: _JobRecord, result: calls.Result) -> calls.Result:
        """A pooled job's sync_weights or load exported its weights: kept for its rollout workers
        (``_replicate``), not passed on to the client."""
        weights = _weights_of(result)
        if weights is None:
            return result
        job.weights = weights
        if isinstance(result, calls.Opened):
            return msgspec.structs.replace(result, source=None)
        return msgspec.structs.replace(result, tensors=None, source=None)

    def _settle_move(self, worker_id: str) -> None:
        """Finish a ``MoveWorker`` once nothing of the old role runs there: a worker leaving
        rollout waits for its running turns (its homes' trainer calls never wait: they run at
        once, exclusive). On CPU the switch itself is free (vLLM has no sleep mode there). What
        the move cost is the time its new role's calls waited: a move to rollout waits for nothing
        here; a move back to training keeps no trainer call waiting, so the drain is not counted."""
        rec = self._workers.get(worker_id)
        if rec is None or rec.moving is None:
            return
        role, since = rec.moving
        if role == "train" and "generate" in self._scheduler.running_on(worker_id):
            return
        rec.moving = None
        rec.role_moves += 1
        cost = 0.0 if role == "train" else self._now() - since
        self._apply(ev.WorkerRole(worker_id, role, seconds=max(cost, 1e-3)))

    def _close_unawaited(self, worker_id: str, job_id: str) -> None:
        """Free what a worker holds of a job nobody can use any more; its answer is dropped."""
        call_id = next(self._call_ids)
        self._unawaited.add(call_id)
        self._send(self._workers[worker_id].ident, m.Execute(rid=call_id, job_id=job_id, call=calls.Close()))

    def _on_state_moved(self, worker_id: str | None, msg: m.StateMoved) -> None:
        move = self._moves.get(msg.rid)
        if move is None or move[0] != worker_id:
            log.warning("dropping StateMoved %d (job %s) that no worker of ours owes", msg.rid, msg.job_id)
            return
        del self._moves[msg.rid]
        if msg.error:
            log.error("worker %s could not move job %s's state to %s: %s", worker_id, msg.job_id, msg.to, msg.error)
        job = self._jobs.get(msg.job_id)
        if job is not None and worker_id is not None:
            now = time.monotonic() - self._clock_zero
            span = Span(self._device_name(worker_id), msg.job_id, f"swap_to_{msg.to}", now - msg.seconds, now,
                        outcome="error" if msg.error else "ok")  # fmt: skip
            self._record(job.owner, span)
        self._apply(ev.SwapDone(msg.job_id, msg.seconds, moved_bytes=msg.bytes, ok=not msg.error))

    def _on_engines_moved(self, worker_id: str | None, msg: m.EnginesMoved) -> None:
        move = self._moves.get(msg.rid)
        if move is None or move[0] != worker_id:
            log.warning("dropping EnginesMoved %d that no worker of ours owes", msg.rid)
            return
        del self._moves[msg.rid]
        if msg.error:
            log.error("worker %s could not put its engines %s: %s; they stay awake", worker_id, msg.to, msg.error)
        job = self._jobs.get(move[1])
        if job is not None and worker_id is not None:
            now = time.monotonic() - self._clock_zero
            name = "sleep" if msg.to == "asleep" else "wake"
            span = Span(self._device_name(worker_id), job.job_id, name, now - msg.seconds, now,
                        outcome="error" if msg.error else "ok")  # fmt: skip
            self._record(job.owner, span)
        self._apply(ev.EnginesMoved(worker_id or "", msg.seconds, ok=not msg.error))

    def _forget(self, rec: _CallRecord) -> None:
        if self._calls.pop(rec.call_id, None) is not None and rec.tenant:
            self._calls_of_tenant[rec.tenant] -= 1
            self._bytes_of_tenant[rec.tenant] -= rec.nbytes
        self._call_of.pop((rec.client, rec.client_rid), None)

    # -- scheduler seam -------------------------------------------------------------------------

    def _apply(self, event: ev.Event) -> None:
        for action in self._scheduler.handle(event, self._now()):
            self._carry_out(action)

    def _carry_out(self, action: ev.Action) -> None:
        match action:
            case ev.Dispatch(call_id, worker_id, priority, exclusive):
                rec = self._calls[call_id]
                rec.worker_id = worker_id
                rec.dispatched_at = time.monotonic()
                call = rec.call
                job = self._jobs.get(rec.job_id)
                # A disaggregated job's sampler worker, or a pooled job's rollout workers, get the weights next.
                export = job is not None and (bool(job.sampler_id) or job.pooled)
                if export and isinstance(call, calls.SyncWeights):
                    via_coordinator = self.config.weights_via == "coordinator"
                    call = calls.SyncWeights(export=not via_coordinator, inline=via_coordinator)
                if export and isinstance(call, calls.Load):
                    call = msgspec.structs.replace(call, export=True)
                if job is not None and job.recoverable and isinstance(call, calls.OptimStep | calls.Load):
                    call = msgspec.structs.replace(call, snapshot=True)  # kept here: _commit
                if job is not None and job.pooled and isinstance(call, calls.Generate) and worker_id != job.worker_id:
                    self._replicate(job, worker_id)
                execute = m.Execute(rid=call_id, job_id=rec.job_id, call=call, priority=priority, exclusive=exclusive)
                self._send(self._workers[worker_id].ident, execute)
            case ev.Fail(job_id, call_id, error):
                failed = self._calls.get(call_id) if call_id is not None else None
                if failed is not None:
                    self._forget(failed)
                    if failed.client:
                        self._reply_error(failed.client, failed.client_rid, error)
                    if (job := self._jobs.get(job_id)) is not None:
                        self._serve_reattach(job)
                if failed is not None and isinstance(failed.call, calls.Open):
                    self._remove_job(job_id)
            case ev.Place():
                raise AssertionError("placement happens only when a job opens")
            case ev.Recover(job_id, worker_id, restore):
                self._recover(self._jobs[job_id], worker_id, restore)
            case ev.Swap(job_id, worker_id, to):
                move_id = next(self._move_ids)
                self._moves[move_id] = (worker_id, job_id)
                self._send(self._workers[worker_id].ident, m.MoveState(rid=move_id, job_id=job_id, to=to))
            case ev.MoveEngines(worker_id, to, level, _, job_id):
                move_id = next(self._move_ids)
                self._moves[move_id] = (worker_id, job_id)
                self._send(self._workers[worker_id].ident, m.MoveEngines(rid=move_id, to=to, level=level))
            case ev.MoveWorker(worker_id, role):
                log.info("worker %s moves to %s", worker_id, role)
                self._workers[worker_id].moving = (role, self._now())
                self._settle_move(worker_id)

    def _lose_worker(self, rec: _WorkerRecord, reason: str) -> None:
        log.warning("worker %s (%s) lost: %s", rec.worker_id, rec.info.name, reason)
        del self._workers[rec.worker_id]
        self._worker_by_ident.pop(rec.ident, None)
        for move_id in [k for k, (w, _) in self._moves.items() if w == rec.worker_id]:
            del self._moves[move_id]  # the scheduler forgets the transfer with the worker
        held = [j for j in self._jobs.values() if rec.worker_id in (j.worker_id, j.sampler_id)]
        self._replicas.pop(rec.worker_id, None)
        for call_id in [c for c, (w, _) in self._replica_calls.items() if w == rec.worker_id]:
            del self._replica_calls[call_id]
        self._apply(ev.WorkerLost(rec.worker_id, reason))
        for call in self._calls.values():
            if call.worker_id == rec.worker_id:  # a pooled job's turn, queued again for another rollout worker
                call.worker_id = None
        for job in held:
            if rec.worker_id in (job.worker_id, job.sampler_id):  # not moved elsewhere (_recover)
                self._mark_lost(job)

    def _recover(self, job: _JobRecord, worker_id: str, restore: bool) -> None:
        """The scheduler moved ``job`` to ``worker_id``: its calls that ran on the lost worker are
        queued again, behind a restore from what ``_commit`` kept (submitted here,
        unless one is already pending)."""
        if worker_id:
            log.warning("job %s goes to worker %s", job.job_id, worker_id)
        else:
            log.warning("job %s waits for a worker that can take it", job.job_id)
        job.worker_id = worker_id
        if worker_id and self._replicas[worker_id].pop(job.job_id, None) is not None:
            self._close_unawaited(worker_id, job.job_id)  # a pooled job's replica there (lent): its home now
        for rec in self._calls.values():
            if rec.job_id == job.job_id:
                rec.worker_id = None  # not running anywhere now; dispatched again on the new home
        if not worker_id and job.state == "closing":  # its state exists nowhere: the close is done
            for rec in [r for r in self._calls.values() if r.job_id == job.job_id and isinstance(r.call, calls.Close)]:
                self._forget(rec)
                if rec.client:
                    self._send(rec.client, m.CallDone(rid=rec.client_rid, job_id=job.job_id, result=calls.Closed()))
            self._remove_job(job.job_id)
            return
        if not restore:
            return
        assert job.open is not None
        call_id = next(self._call_ids)
        # A pooled job's rollout workers fetch its weights from its new home from now on.
        call = calls.Restore(open=job.open, snapshot=job.snapshot, replay=list(job.replay), export=job.pooled)
        self._calls[call_id] = _CallRecord(call_id, job.job_id, b"", 0, call)
        self._apply(ev.CallSubmitted(call_id, job.job_id, "restore", front=True))

    # -- outbound -------------------------------------------------------------------------------

    def _send(self, ident: bytes, msg: msgspec.Struct) -> None:
        assert self._pump is not None
        try:
            frames = self._codec.encode(msg)
        except PlexError as e:  # a result too large for the wire: tell the client instead
            frames = self._codec.encode(m.ErrorReply(rid=getattr(msg, "rid", 0), code=e.code, message=e.message))
        try:
            self._pump.send([ident, *frames])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                log.debug("%s left before its %s could be sent", ident.hex(), type(msg).__name__)  # a closed client
            else:  # EAGAIN: the peer stopped reading and its queue is full
                log.warning("could not send %s to %s: %s", type(msg).__name__, ident.hex(), e)

    def _reply_error(self, ident: bytes, rid: int, err: PlexError) -> None:
        self._send(ident, m.ErrorReply(rid=rid, code=err.code, message=err.message))

    def _record_span(self, worker_id: str, rec: _CallRecord, error: bool, owner: str) -> None:
        """A finished call into the trace (and the metrics' latency histograms). Swaps and tool
        waits go into it too (``_on_state_moved``, ``_submit``)."""
        finished = time.monotonic()
        queued, ran = rec.dispatched_at - rec.submitted_at, finished - rec.dispatched_at
        if self._metrics is not None:
            self._metrics.observe(rec.call, error, queued, ran)
        start = rec.dispatched_at - self._clock_zero
        span = Span(device=self._device_name(worker_id), job=rec.job_id, kind=calls.CALL_KIND[type(rec.call)], start_s=start,
                    end_s=start + ran, queued_s=queued, outcome="error" if error else "ok")  # fmt: skip
        self._record(owner, span)

    def _record(self, owner: str, span: Span) -> None:
        self._spans.append((owner, span))
        self._spans_recorded += 1

    def _device_name(self, worker_id: str) -> str:
        worker = self._workers.get(worker_id)
        return worker.info.name if worker is not None else worker_id

    def _trace(self, rid: int, asker: _Peer) -> m.TraceReply:
        """The asker's jobs' spans (an admin's: everyone's)."""
        spans = [s for owner, s in self._spans if asker.admin or owner == asker.tenant]
        return m.TraceReply(rid=rid, spans=spans, dropped=self._spans_recorded - len(self._spans))

    async def _admin_status(self) -> m.StatusReply:
        """Everything ``plexrl status`` shows an admin (the metrics endpoint's scrape)."""
        return self._status(0, _Peer(tenant="", admin=True))

    def _status(self, rid: int, asker: _Peer) -> m.StatusReply:
        """Workers, and jobs: the asker's own in full; other tenants' without names or details
        (where they run and their state only), unless the asker is an admin."""
        now = self._now()

        def visible(j: _JobRecord) -> bool:
            return asker.admin or j.owner == asker.tenant

        roles = {w.worker_id: w for w in self._scheduler.workers()}
        workers = [
            m.WorkerInfo(
                worker_id=w.worker_id,
                name=w.info.name,
                device=w.info.device,
                engines=w.info.engines,
                memory_budget_bytes=_bytes(self._scheduler.budget(w.worker_id)),
                jobs=sorted(j.job_id if visible(j) else "" for j in self._jobs.values() if j.worker_id == w.worker_id),
                calls_done=w.calls_done,
                busy_s=self._scheduler.busy_s(w.worker_id, now),
                pid=w.info.pid,
                state_bytes_on_device=self._scheduler.used_bytes(w.worker_id),
                role=roles[w.worker_id].role,
                bucket=roles[w.worker_id].bucket,
                role_moves=w.role_moves,
            )
            for w in self._workers.values()
        ]
        jobs = [self._job_info(j, now) if visible(j) else _redacted(j) for j in self._jobs.values()]
        return m.StatusReply(rid=rid, workers=workers, jobs=jobs, uptime_s=now - self._started)

    def _job_info(self, j: _JobRecord, now: float) -> m.JobInfo:
        ledger = self._scheduler.ledger
        usage = ledger.jobs.get(j.job_id)
        residency = self._scheduler.residency(j.job_id)
        return m.JobInfo(
            job_id=j.job_id,
            name=j.name,
            owner=self._owner_name(j.owner),
            worker_id=j.worker_id,
            queued=self._scheduler.queued(j.job_id),
            running=self._scheduler.is_running(j.job_id),
            calls_done=j.calls_done,
            state=j.state,
            tier=residency.tier if residency else "",
            sampler_worker_id=j.sampler_id,
            state_bytes=residency.state_bytes if residency else 0,
            wall_s=usage.wall_s(now) if usage else 0.0,
            accelerator_s=ledger.accelerator_s(j.job_id, now),
            swaps=usage.swaps if usage else 0,
            swap_bytes=usage.swap_bytes if usage else 0,
            swap_s=usage.swap_s if usage else 0.0,
            recoveries=j.recoveries,
        )

    def _tenant_folder(self, ident: bytes) -> str:
        """The worker-side checkpoint folder of the tenant behind ``ident``: its key's name (every
        job of an unauthenticated coordinator shares one, ``shared``)."""
        return "" if self._allowlist is None else self._allowlist.name(self._peers[ident].tenant)

    def _owner_name(self, tenant: str) -> str:
        return tenant if self._allowlist is None else self._allowlist.name(tenant)


def _bytes(n: float) -> int:
    """A byte count for the wire (an unbounded budget as 0: none)."""
    return 0 if math.isinf(n) else max(0, int(n))


def _redacted(j: _JobRecord) -> m.JobInfo:
    """Another tenant's job as ``plexrl status`` shows it: where it runs and its state, nothing else."""
    return m.JobInfo(job_id="", name="", owner="", worker_id=j.worker_id, queued=0, running=False, calls_done=0,
                     state=j.state)  # fmt: skip


def _signals(turn: m.TurnOf) -> ev.TurnSignals:
    return ev.TurnSignals(turn.turn, turn.tool_errors, turn.retries, turn.tokens, turn.token_budget)


def _validate(call: calls.Call) -> None:
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


async def run_coordinator(config: CoordinatorConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then fail in-flight calls and exit cleanly."""
    import signal

    coordinator = Coordinator(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, coordinator.stop)
    await coordinator.serve(on_ready)


def _weights_of(result: calls.Result) -> calls.SetWeights | None:
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
