"""The coordinator process: one asyncio loop, one ROUTER socket, the scheduler behind one seam.

Clients and workers are DEALER peers of the same ROUTER. This module is the transport: it decodes
each inbound message, checks who sent it (keys, roles), keeps connections alive (heartbeats,
client leases, hung workers) and hands the message on: workers' registrations and state moves
become scheduler events here; clients' jobs and calls, and their outcomes, go to the book
(``book.py``). Every scheduler action is carried out through ``_carry_out``. The coordinator does
no tensor math: arrays in calls and results pass through as zero-copy frames.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
from collections.abc import Callable

import msgspec
import zmq

from plexrl.coordinator import events as ev
from plexrl.coordinator import scheduler as sch
from plexrl.coordinator.book import Book
from plexrl.coordinator.buckets import Mlfq
from plexrl.coordinator.config import CoordinatorConfig
from plexrl.coordinator.metrics import Metrics
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.records import (
    JobRecord,
    Peer,
    StatusWaiter,
    WorkerRecord,
)
from plexrl.coordinator.reports import Reports
from plexrl.errors import (
    CoordinatorLostError,
    InvalidRequestError,
    NotAuthorizedError,
    PlexError,
    UnknownClientError,
)
from plexrl.names import ROLES, is_role
from plexrl.protocol import auth
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec, rid_of
from plexrl.protocol.liveness import Liveness
from plexrl.protocol.pump import Frames, Pump

log = logging.getLogger("plexrl.coordinator")

TICK_S = 0.1  # how often jobs waiting for device room are re-checked
# Calls whose engine work ticks the worker's progress (a decoding step, a row group's forward or
# backward, an optimizer step): one running with the count standing still means a hung engine.
# The others (open, save, load, ...) may load models or write files for long stretches: their
# deadlines bound them.
PROGRESSING = frozenset({"generate", "logprobs", "forward_backward", "optim_step"})
_WORKER_MESSAGES = (m.Register, m.CallDone, m.ErrorReply, m.StateMoved, m.EnginesMoved)
_CLIENT_MESSAGES = (m.Hello, m.OpenJob, m.Submit, m.Cancel, m.StatusRequest, m.TraceRequest, m.Reattach)
# What a worker's switch between roles costs once drained, as told to the rebalancer: a worker does
# nothing to switch yet (its engines stay as they are), so a token figure.
ROLE_SWITCH_S = 1e-3


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
        self._workers: dict[str, WorkerRecord] = {}
        self._worker_by_ident: dict[bytes, str] = {}
        jobs: dict[str, JobRecord] = {}  # the book's, read by the reports
        self._waiters: list[StatusWaiter] = []
        self._clients: dict[bytes, Liveness] = {}  # connected clients and their heartbeats
        self._inbound_bytes = 0  # the size of the message being handled
        self._worker_ids = itertools.count(0)
        self._move_ids = itertools.count(1)
        # move id -> (worker, job) awaiting StateMoved, or EnginesMoved (the job its engines move for)
        self._moves: dict[int, tuple[str, str]] = {}
        self._stopping = asyncio.Event()
        self._pump: Pump | None = None
        self._allowlist = None if config.keys is None else auth.Allowlist(config.keys)
        self._peers: dict[bytes, Peer] = {}  # connection -> its tenant
        self._hung: set[bytes] = set()  # call sockets of workers declared hung (told to exit)
        self._metrics = None if config.metrics_port is None else Metrics()
        self._reports = Reports(self._scheduler, self._workers, jobs, self._owner_name, self._metrics, config.clock)
        self._book = Book(config, self._scheduler, self._reports, jobs, self._workers, self._peers, self._allowlist,
                          self._send, self._apply, self._carry_out)  # fmt: skip
        self.metrics_address = ""  # http://host:port/metrics once serving

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
        self._book.resume_journaled()
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
            self._book.close()
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
        if self.config.journal is not None:
            return
        self._book.fail_calls(CoordinatorLostError("the coordinator shut down before the call finished"))
        for ident in self._clients:
            self._send(ident, m.Shutdown(reason="the coordinator shut down"))

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
                self._peers[ident] = Peer(ident.hex(), admin=True)  # a connection is a tenant; no secrets
            return
        user = frame.get("User-Id")  # the key ZAP admitted the connection with (z85)
        role = self._allowlist.role(user if isinstance(user, str) else None)
        if isinstance(user, str) and role is not None and ident not in self._peers:
            self._peers[ident] = Peer(user, admin=role == "admin")  # a connection keeps its key
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
            self._book.free_unclaimed(self._now())

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
            case m.Heartbeat(worker=call_ident) if call_ident:
                self._worker_heartbeat(ident, msg)
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
                self._hello(ident, rid)
            case m.Register():
                self._register_worker(ident, msg)
            case m.OpenJob():
                self._book.open_job(ident, msg)
            case m.Submit():
                self._book.submit(ident, msg, self._inbound_bytes)
            case m.Cancel(call_rid=call_rid):
                self._book.cancel(ident, call_rid)
            case m.TraceRequest(rid=rid):
                self._send(ident, self._reports.trace(rid, self._peers[ident]))
            case m.StatusRequest(rid=rid, min_workers=n):
                if len(self._workers) >= n:
                    self._send(ident, self._status(rid, self._peers[ident]))
                else:
                    self._waiters.append(StatusWaiter(ident, rid, n))
            case m.Reattach(rid=rid, name=name, job_id=job_id, token=token):
                self._book.reattach(ident, rid, name, job_id, token)
            case m.StateMoved():
                self._on_state_moved(worker_id, msg)
            case m.EnginesMoved():
                self._on_engines_moved(worker_id, msg)
            case m.CallDone() | m.ErrorReply() if worker_id is not None:
                self._book.on_call_outcome(worker_id, msg)
            case m.CallDone() | m.ErrorReply():
                log.warning("dropping %s from %s, which is not a registered worker", type(msg).__name__, ident.hex())

    def _worker_heartbeat(self, ident: bytes, msg: m.Heartbeat) -> None:
        """A worker's heartbeat thread (its call socket's identity in ``msg.worker``), with its
        engine's progress count (``_liveness_loop`` declares a worker hung when it stands still)."""
        known = self._worker_by_ident.get(msg.worker)
        if known is None:
            hung = msg.worker in self._hung
            reason = "declared hung" if hung else "this worker is not registered here"
            self._send(ident, m.Shutdown(rid=msg.rid, reason=reason, exit=hung))
            return
        rec = self._workers[known]
        rec.liveness.heard()
        if msg.progress != rec.progress:
            rec.progress, rec.progress_at = msg.progress, self._now()
        self._send(ident, m.Heartbeat(rid=msg.rid))

    def _hello(self, ident: bytes, rid: int) -> None:
        """A client connects: its lease starts (``client_timeout_s`` of silence ends it)."""
        beats = max(1, math.ceil(self.config.client_timeout_s / self.config.heartbeat_interval_s))
        self._clients[ident] = Liveness(beats)
        interval, liveness = self.config.heartbeat_interval_s, self.config.heartbeat_liveness
        welcome = m.Welcome(rid=rid, client_id=ident.hex(), heartbeat_interval_s=interval, heartbeat_liveness=liveness)
        self._send(ident, welcome)

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
        self._workers[worker_id] = WorkerRecord(
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
            background_calls=tuple(msg.background_calls), node=msg.node, index=msg.index,
        )  # fmt: skip
        self._apply(joined)
        for w in [w for w in self._waiters if len(self._workers) >= w.min_workers]:
            self._waiters.remove(w)
            self._send(w.client, self._status(w.rid, self._peers[w.client]))

    # -- client leases ---------------------------------------------------------------------------

    def _lose_client(self, ident: bytes) -> None:
        """A client silent for the liveness window: its calls are cancelled, its jobs suspended."""
        del self._clients[ident]
        self._peers.pop(ident, None)
        self._waiters = [w for w in self._waiters if w.client != ident]
        self._book.lose_client(ident)

    def _on_state_moved(self, worker_id: str | None, msg: m.StateMoved) -> None:
        move = self._moves.get(msg.rid)
        if move is None or move[0] != worker_id:
            log.warning("dropping StateMoved %d (job %s) that no worker of ours owes", msg.rid, msg.job_id)
            return
        del self._moves[msg.rid]
        if msg.error:
            log.error("worker %s could not move job %s's state to %s: %s", worker_id, msg.job_id, msg.to, msg.error)
        job = self._book.job(msg.job_id)
        if job is not None and worker_id is not None:
            self._reports.span(job.owner, worker_id, msg.job_id, f"swap_to_{msg.to}", msg.seconds, bool(msg.error))
        self._apply(ev.SwapDone(msg.job_id, msg.seconds, moved_bytes=msg.bytes, ok=not msg.error, worker_id=move[0]))

    def _on_engines_moved(self, worker_id: str | None, msg: m.EnginesMoved) -> None:
        move = self._moves.get(msg.rid)
        if move is None or move[0] != worker_id:
            log.warning("dropping EnginesMoved %d that no worker of ours owes", msg.rid)
            return
        del self._moves[msg.rid]
        if msg.error:
            log.error("worker %s could not put its engines %s: %s; they stay awake", worker_id, msg.to, msg.error)
        job = self._book.job(move[1])
        if job is not None and worker_id is not None:
            name = "sleep" if msg.to == "asleep" else "wake"
            self._reports.span(job.owner, worker_id, job.job_id, name, msg.seconds, bool(msg.error))
        self._apply(ev.EnginesMoved(worker_id or "", msg.seconds, ok=not msg.error))

    # -- scheduler seam -------------------------------------------------------------------------

    def _apply(self, event: ev.Event) -> None:
        for action in self._scheduler.handle(event, self._now()):
            self._carry_out(action)

    def _carry_out(self, action: ev.Action) -> None:
        if self._book.carry_out(action):
            return
        match action:
            case ev.Swap(job_id, worker_id, to):
                move_id = next(self._move_ids)
                self._moves[move_id] = (worker_id, job_id)
                self._send(self._workers[worker_id].ident, m.MoveState(rid=move_id, job_id=job_id, to=to))
            case ev.MoveEngines(worker_id, to, level, _, job_id):
                move_id = next(self._move_ids)
                self._moves[move_id] = (worker_id, job_id)
                self._send(self._workers[worker_id].ident, m.MoveEngines(rid=move_id, to=to, level=level))
            case ev.MoveWorker(worker_id, role):  # it has drained: the switch itself costs nothing yet
                log.info("worker %s moves to %s", worker_id, role)
                self._workers[worker_id].role_moves += 1
                self._apply(ev.WorkerRole(worker_id, role, seconds=ROLE_SWITCH_S))

    def _lose_worker(self, rec: WorkerRecord, reason: str) -> None:
        log.warning("worker %s (%s) lost: %s", rec.worker_id, rec.info.name, reason)
        del self._workers[rec.worker_id]
        self._worker_by_ident.pop(rec.ident, None)
        for move_id in [k for k, (w, _) in self._moves.items() if w == rec.worker_id]:
            del self._moves[move_id]  # the scheduler forgets the transfer with the worker
        self._book.forget_worker(rec.worker_id)
        self._apply(ev.WorkerLost(rec.worker_id, reason))  # its calls fail, or are queued again

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

    async def _admin_status(self) -> m.StatusReply:
        """Everything ``plexrl status`` shows an admin (the metrics endpoint's scrape)."""
        return self._status(0, Peer(tenant="", admin=True))

    def _status(self, rid: int, asker: Peer) -> m.StatusReply:
        return self._reports.status(rid, asker, self._now(), self._now() - self._started)

    def _owner_name(self, tenant: str) -> str:
        return tenant if self._allowlist is None else self._allowlist.name(tenant)


async def run_coordinator(config: CoordinatorConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then fail in-flight calls and exit cleanly."""
    import signal

    coordinator = Coordinator(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, coordinator.stop)
    await coordinator.serve(on_ready)
