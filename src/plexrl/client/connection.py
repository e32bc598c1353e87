"""A client's connection to a coordinator: requests as futures, replies matched by request id.

Requests are sent the moment they are made (so one job's calls reach the coordinator in the
order the script made them) and return an ``asyncio.Future``. A receive loop resolves futures;
a heartbeat loop declares the coordinator lost after ``liveness`` silent intervals and fails
every pending future with :class:`CoordinatorLostError`, so no await can hang forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import os
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from plexrl.errors import CallTimeoutError, CoordinatorLostError, PlexError, from_wire
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Codec, rid_of
from plexrl.protocol.liveness import Liveness
from plexrl.protocol.pump import Frames, Pump

if TYPE_CHECKING:
    from plexrl.client.job import Job

log = logging.getLogger("plexrl.client")

T = TypeVar("T")
current_client: contextvars.ContextVar[Client | None] = contextvars.ContextVar("plexrl_client", default=None)

# Seconds a call of each kind may take, queueing included, before it fails with CallTimeoutError
# (generous: a shared cluster can queue a call behind other jobs for minutes). Override per client.
DEADLINES_S: dict[str, float] = {
    "generate": 1800.0,
    "logprobs": 900.0,
    "forward_backward": 1800.0,
    "optim_step": 600.0,
    "sync_weights": 600.0,
    "save": 900.0,
    "load": 900.0,
    "close": 600.0,
    "open_job": 900.0,
}


class Client:
    """``async with Client(address) as client:``; or ``plexrl.connect(address)``."""

    def __init__(
        self,
        address: str,
        *,
        name: str = "",
        connect_timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: auth.Credentials | None = None,
        deadlines: dict[str, float] | None = None,
    ) -> None:
        self.address = address
        # Per call kind ("generate", "forward_backward", ..., "open_job"): seconds until
        # CallTimeoutError; a kind missing here waits for its reply (or the coordinator's loss).
        self.deadlines = {**DEADLINES_S, **(deadlines or {})}
        # A client key (CurveZMQ): given, else $PLEXRL_KEY / $PLEXRL_COORDINATOR_KEY, else none
        # (a coordinator started with --insecure).
        self.credentials = credentials if credentials is not None else auth.Credentials.from_env()
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.client_id = ""
        self._codec: Codec[m.CoordinatorToClient] = Codec(m.CoordinatorToClient, max_bytes=max_message_bytes)
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], Callable[[Any], Any]]] = {}
        self._dead: PlexError | None = None
        self._liveness: Liveness | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pump: Pump | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._token: contextvars.Token[Client | None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, os.urandom(8))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.credentials is not None:
            self.credentials.apply(sock)
        sock.connect(self.address)
        self._pump = Pump(sock, self._on_frames)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                welcome: m.Welcome = await self.request(m.Hello(client_name=self.name), expect(m.Welcome))
        except TimeoutError:
            await self._close(CoordinatorLostError("never connected"))
            raise CoordinatorLostError(
                f"no coordinator answered at {self.address} within {self.connect_timeout_s} s: start one with "
                f"`plexrl coordinator --bind {self.address} --keys DIR`, or use plexrl.local() for an embedded "
                "cluster; a coordinator with keys also stays silent to a key it does not list "
                f"({'no key given' if self.credentials is None else 'this client connected with a key'}: "
                "credentials=, or $PLEXRL_KEY and $PLEXRL_COORDINATOR_KEY)"
            ) from None
        except BaseException:
            await self._close(CoordinatorLostError("never connected"))
            raise
        self.client_id = welcome.client_id
        self._tasks.append(
            asyncio.create_task(
                self._heartbeat_loop(welcome.heartbeat_interval_s, welcome.heartbeat_liveness),
                name="plexrl-client-heartbeat",
            )
        )
        self._token = current_client.set(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            current_client.reset(self._token)
            self._token = None
        await self._close(CoordinatorLostError("the client was closed before the call finished"))

    async def _close(self, err: PlexError) -> None:
        self._fail_all(err)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, PlexError):
                await t
        self._tasks = []
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def lost(self) -> bool:
        """True once the coordinator shut down or stopped answering heartbeats."""
        return self._dead is not None

    # -- requests -------------------------------------------------------------------------------

    def request(
        self, msg: msgspec.Struct, unwrap: Callable[[Any], T], deadline_s: float | None = None
    ) -> asyncio.Future[T]:
        """Send ``msg`` now (with a fresh request id) and return the future of its reply; past
        ``deadline_s`` the request is cancelled at the coordinator and fails with CallTimeoutError."""
        if self._dead is not None:
            raise type(self._dead)(self._dead.message)
        if self._pump is None:
            raise CoordinatorLostError("the client is not connected: use `async with plexrl.connect(...)`")
        rid = next(self._rids)
        frames = self._codec.encode(msgspec.structs.replace(msg, rid=rid))
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            self._pump.send(frames)
        except zmq.ZMQError as e:  # EAGAIN: 100k messages queued and the coordinator reads none
            raise CoordinatorLostError(f"could not send to the coordinator at {self.address}: {e}") from None
        self._pending[rid] = (fut, unwrap)
        fut.add_done_callback(functools.partial(self._on_done, rid))
        if deadline_s is not None:
            timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, rid, type(msg).__name__, deadline_s)
            fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def _expire(self, rid: int, what: str, deadline_s: float) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None or entry[0].done():
            return
        self._send_cancel(rid)  # dropped if queued, aborted if running (a vLLM generate)
        entry[0].set_exception(
            CallTimeoutError(f"{what} got no answer within its deadline of {deadline_s:g} s (Client.deadlines)")
        )

    def abort(self, fut: asyncio.Future[Any]) -> None:
        """Abort the call behind ``fut`` and keep waiting for its outcome: ``CallAbortedError`` if
        it was still queued or its engine could stop it (a vLLM generate), else its result."""
        rid = next((r for r, (f, _) in self._pending.items() if f is fut), None)
        if rid is not None:
            self._send_cancel(rid)

    def _on_done(self, rid: int, fut: asyncio.Future[Any]) -> None:
        """A request the caller cancelled is cancelled at the coordinator too (dropped if queued,
        aborted if running), so a job's later calls do not wait behind it."""
        if fut.cancelled() and self._pending.pop(rid, None) is not None:
            self._send_cancel(rid)

    def _send_cancel(self, rid: int) -> None:
        if self._pump is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._pump.send(self._codec.encode(m.Cancel(rid=next(self._rids), call_rid=rid)))

    def submit(self, job_id: str, call: calls.Call, result_type: type[T], priority: int = 0) -> asyncio.Future[T]:
        deadline = self.deadlines.get(calls.CALL_KIND[type(call)])
        return self.request(m.Submit(job_id=job_id, call=call, priority=priority), expect_result(result_type), deadline)

    async def open_job(
        self, name: str, spec: calls.JobSpec, weight: float = 1.0, placement: str = "colocated"
    ) -> tuple[str, calls.Opened]:
        request = m.OpenJob(name=name, spec=spec, weight=weight, placement=placement)
        done: m.CallDone = await self.request(request, expect(m.CallDone), self.deadlines.get("open_job"))
        if not isinstance(done.result, calls.Opened):
            raise PlexError(f"coordinator answered OpenJob with {type(done.result).__name__}")
        return done.job_id, done.result

    async def reattach(self, name: str) -> Job:
        """Take over this tenant's job ``name`` after its client went away (a restarted script, the
        same key): returns its ``Job`` handle, state and weights as they were. If the old client is
        not yet declared gone (the coordinator's ``--client-timeout``), this waits until it is.
        ``UnknownJobError`` if no such job is open or suspended (its grace period ran out)."""
        from plexrl.client.job import Job  # job.py imports this module

        done: m.Reattached = await self.request(m.Reattach(name=name), expect(m.Reattached))
        return Job(self, done.job_id, done.name, done.spec, done.opened)

    async def status(self, min_workers: int = 0) -> m.StatusReply:
        """The coordinator's view of workers and jobs, once ``min_workers`` have registered."""
        return await self.request(m.StatusRequest(min_workers=min_workers), expect(m.StatusReply))

    # -- loops ----------------------------------------------------------------------------------

    def _on_frames(self, frames: Frames) -> None:
        if self._liveness is not None:
            self._liveness.heard()
        try:
            msg = self._codec.decode(frames)
        except PlexError as e:
            # The reply's request id is read before the body: its caller gets the error, not a hang.
            entry = self._pending.pop(rid_of(e), None)
            log.error("undecodable message from the coordinator%s: %s", " (failing its call)" if entry else "", e)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(e)
            return
        if isinstance(msg, m.Heartbeat):
            return
        if isinstance(msg, m.Shutdown):
            self._dead = CoordinatorLostError(f"{msg.reason} ({self.address})")
            self._fail_all(self._dead)
            return
        entry = self._pending.pop(msg.rid, None)
        if entry is None:
            return  # the caller gave up on it (cancelled)
        fut, unwrap = entry
        if fut.done():
            return
        if isinstance(msg, m.ErrorReply):
            fut.set_exception(from_wire(msg.code, msg.message))
            return
        try:
            fut.set_result(unwrap(msg))
        except PlexError as e:
            fut.set_exception(e)

    async def _heartbeat_loop(self, interval: float, liveness: int) -> None:
        self._liveness = live = Liveness(liveness)
        while True:
            if self._pump is not None:
                with contextlib.suppress(zmq.Again):  # a full queue: the liveness count decides
                    self._pump.send(self._codec.encode(m.Heartbeat()))
            await asyncio.sleep(interval)
            if not live.tick():
                err = CoordinatorLostError(
                    f"the coordinator at {self.address} has not answered for {liveness} heartbeats "
                    f"({interval * liveness:.1f} s); check that it is running, then reconnect"
                )
                self._dead = err
                self._fail_all(err)
                return

    def _fail_all(self, err: PlexError) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(type(err)(err.message))


def expect(t: type[T]) -> Callable[[Any], T]:
    """An ``unwrap`` for :meth:`Client.request` whose reply must be a ``t`` message."""

    def unwrap(msg: Any) -> T:
        if not isinstance(msg, t):
            raise PlexError(f"expected {t.__name__} from the coordinator, got {type(msg).__name__}")
        return msg

    return unwrap


def expect_result(t: type[T]) -> Callable[[Any], T]:
    """An ``unwrap`` for a submitted call whose ``CallDone`` must carry a ``t`` result."""

    def unwrap(msg: Any) -> T:
        if not isinstance(msg, m.CallDone) or not isinstance(msg.result, t):
            got = type(msg.result if isinstance(msg, m.CallDone) else msg).__name__
            raise PlexError(f"expected {t.__name__} from the coordinator, got {got}")
        return msg.result

    return unwrap


def connect(
    address: str,
    *,
    name: str = "",
    connect_timeout_s: float = 30.0,
    credentials: auth.Credentials | None = None,
    deadlines: dict[str, float] | None = None,
) -> Client:
    """Connect to a shared coordinator: ``async with plexrl.connect("tcp://head:7400"):``.

    ``credentials``: your client key, ``plexrl.Credentials.load("alice.key_secret", "coordinator.key")``;
    by default ``$PLEXRL_KEY`` and ``$PLEXRL_COORDINATOR_KEY`` name those two files.
    ``deadlines``: seconds per call kind before ``CallTimeoutError`` (defaults: ``DEADLINES_S``).
    """
    return Client(address, name=name, connect_timeout_s=connect_timeout_s, credentials=credentials, deadlines=deadlines)
