"""A client's connection to a coordinator: requests as futures, replies matched by request id.

Requests are sent the moment they are made (so one job's calls reach the coordinator in the
order the script made them) and return an ``asyncio.Future``. A receive loop resolves futures;
a heartbeat loop notices a silent coordinator after ``liveness`` intervals.

A coordinator that restarts (with a journal) or that declared this client gone does not know
the connection any more: the client *resumes*. It says Hello again (waiting up to
``reconnect_s`` for a coordinator to answer), reattaches each of its open jobs, and settles each
unanswered call by the job's commit point (``Reattached.committed_seq``): a call the job has not
seen is sent again, the last call it holds gets its journaled result, and an older call whose
result was lost fails with :class:`ResultLostError` (saying whether it was applied). Requests
made meanwhile wait and go out after. If no coordinator answers, every pending future fails with
:class:`CoordinatorLostError`, so no await can hang forever.
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
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from plexrl.errors import (
    CallTimeoutError,
    CoordinatorLostError,
    PlexError,
    ResultLostError,
    UnknownClientError,
    UnknownJobError,
    from_wire,
)
from plexrl.names import Placement
from plexrl.plan import JobShape, ModelShape
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
STATEFUL_KINDS = frozenset({"forward_backward", "optim_step", "sync_weights", "load"})  # they change a job


@dataclass(eq=False)
class _Request:
    """An unanswered request; sent again, under a new request id, when the client resumes."""

    msg: msgspec.Struct  # as the caller made it
    fut: asyncio.Future[Any]
    unwrap: Callable[[Any], Any]
    rid: int = 0  # its request id once sent (0: not sent yet)
    resuming: bool = False  # made by the resume itself (sent at once, never held or re-sent)


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
        reconnect_s: float = 120.0,
    ) -> None:
        self.address = address
        # How long a client whose coordinator went silent (or forgot it) waits for one to answer
        # again (a restart with a journal) before it fails every pending call; 0: it fails at once.
        self.reconnect_s = reconnect_s
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
        self._pending: dict[int, _Request] = {}  # sent, by request id
        self._held: list[_Request] = []  # made while resuming: sent once it is done
        self._resume: asyncio.Task[None] | None = None
        self.jobs: dict[str, Job] = {}  # this client's open jobs (a resume reattaches them)
        self._dead: PlexError | None = None
        self._liveness: Liveness | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pump: Pump | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._token: contextvars.Token[Client | None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        await self.open()
        self._token = current_client.set(self)  # what plexrl.job() and friends use
        return self

    async def open(self) -> None:
        """Connect (``async with`` does this, and makes the client the current one): for code
        that holds several clients, such as the Tinker gateway's one per tenant; ``close()`` after."""
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

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            current_client.reset(self._token)
            self._token = None
        await self.close()

    async def close(self) -> None:
        """Disconnect; calls still in flight fail with ``CoordinatorLostError``."""
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
        return self._request(msg, unwrap, deadline_s)

    def _request(
        self, msg: msgspec.Struct, unwrap: Callable[[Any], T], deadline_s: float | None = None, resuming: bool = False
    ) -> asyncio.Future[T]:
        if self._dead is not None:
            raise type(self._dead)(self._dead.message)
        if self._pump is None:
            raise CoordinatorLostError("the client is not connected: use `async with plexrl.connect(...)`")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        req = _Request(msg, fut, unwrap, resuming=resuming)
        if self._resume is None or resuming:
            self._send(req)
        else:
            self._held.append(req)  # after the resume, in order
        fut.add_done_callback(functools.partial(self._on_done, req))
        if deadline_s is not None:
            timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, req, deadline_s)
            fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def _send(self, req: _Request) -> None:
        assert self._pump is not None
        rid = next(self._rids)
        try:
            self._pump.send(self._codec.encode(msgspec.structs.replace(req.msg, rid=rid)))
        except zmq.ZMQError as e:  # EAGAIN: 100k messages queued and the coordinator reads none
            raise CoordinatorLostError(f"could not send to the coordinator at {self.address}: {e}") from None
        req.rid = rid
        self._pending[rid] = req

    def _drop(self, req: _Request) -> bool:
        """Stop tracking ``req``; True if it had been sent (so the coordinator may hold it)."""
        if req in self._held:
            self._held.remove(req)
        return self._pending.pop(req.rid, None) is req

    def _expire(self, req: _Request, deadline_s: float) -> None:
        if req.fut.done():
            return
        if self._drop(req):
            self._send_cancel(req.rid)  # dropped if queued, aborted if running (a vLLM generate)
        what = type(req.msg).__name__
        req.fut.set_exception(
            CallTimeoutError(f"{what} got no answer within its deadline of {deadline_s:g} s (Client.deadlines)")
        )

    def abort(self, fut: asyncio.Future[Any]) -> None:
        """Abort the call behind ``fut`` and keep waiting for its outcome: ``CallAbortedError`` if
        it was still queued or its engine could stop it (a vLLM generate), else its result."""
        rid = next((r for r, req in self._pending.items() if req.fut is fut), None)
        if rid is not None:
            self._send_cancel(rid)

    def _on_done(self, req: _Request, fut: asyncio.Future[Any]) -> None:
        """A request the caller cancelled is cancelled at the coordinator too (dropped if queued,
        aborted if running), so a job's later calls do not wait behind it."""
        if fut.cancelled() and self._drop(req):
            self._send_cancel(req.rid)

    def _send_cancel(self, rid: int) -> None:
        if self._pump is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._pump.send(self._codec.encode(m.Cancel(rid=next(self._rids), call_rid=rid)))

    def submit(
        self,
        job_id: str,
        call: calls.Call,
        result_type: type[T],
        priority: int = 0,
        seq: int = 0,
        turn: m.TurnOf | None = None,
    ) -> asyncio.Future[T]:
        """Submit ``call`` to the job, as its ``seq``-th call (its ``Job`` numbers them); ``turn``:
        the trajectory a generate continues."""
        deadline = self.deadlines.get(calls.CALL_KIND[type(call)])
        submit = m.Submit(job_id=job_id, call=call, priority=priority, seq=seq, turn=turn)
        return self.request(submit, expect_result(result_type), deadline)

    async def open_job(
        self, name: str, spec: calls.JobSpec, weight: float = 1.0, placement: Placement = "colocated", devices: int = 1
    ) -> tuple[str, calls.Opened]:
        request = m.OpenJob(
            name=name, spec=spec, weight=weight, placement=placement, token=os.urandom(8).hex(),
            shape=job_shape(spec, devices), devices=devices,
        )  # fmt: skip
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
        return Job(
            self, done.job_id, done.name, done.spec, done.opened, next_seq=done.next_seq, generates=done.generates
        )

    async def status(self, min_workers: int = 0) -> m.StatusReply:
        """The coordinator's view of workers and jobs, once ``min_workers`` have registered."""
        return await self.request(m.StatusRequest(min_workers=min_workers), expect(m.StatusReply))

    async def trace(self) -> m.TraceReply:
        """The most recent calls of your jobs (an admin key: of every job) as spans, oldest first;
        ``plexrl.trace.chrome_trace(reply.spans)`` makes a trace file of them."""
        return await self.request(m.TraceRequest(), expect(m.TraceReply))

    # -- loops ----------------------------------------------------------------------------------

    def _on_frames(self, frames: Frames) -> None:
        if self._liveness is not None:
            self._liveness.heard()
        try:
            msg = self._codec.decode(frames)
        except PlexError as e:
            # The reply's request id is read before the body: its caller gets the error, not a hang.
            req = self._pending.pop(rid_of(e), None)
            log.error("undecodable message from the coordinator%s: %s", " (failing its call)" if req else "", e)
            if req is not None and not req.fut.done():
                req.fut.set_exception(e)
            return
        if isinstance(msg, m.Heartbeat):
            if not msg.known:
                self._start_resume("the coordinator does not know this client (it restarted, or declared it gone)")
            return
        if isinstance(msg, m.Shutdown):
            self._dead = CoordinatorLostError(f"{msg.reason} ({self.address})")
            self._fail_all(self._dead)
            return
        forgotten = isinstance(msg, m.ErrorReply) and msg.code == UnknownClientError.code
        if forgotten and msg.rid in self._pending and not self._pending[msg.rid].resuming:
            self._start_resume("the coordinator does not know this client (it restarted, or declared it gone)")
            return  # the call stays pending: the resume settles it
        req = self._pending.pop(msg.rid, None)
        if req is None or req.fut.done():
            return  # the caller gave up on it (cancelled)
        if isinstance(msg, m.ErrorReply):
            req.fut.set_exception(from_wire(msg.code, msg.message))
            return
        try:
            req.fut.set_result(req.unwrap(msg))
        except PlexError as e:
            req.fut.set_exception(e)

    async def _heartbeat_loop(self, interval: float, liveness: int) -> None:
        self._liveness = live = Liveness(liveness)
        while True:
            if self._pump is not None:
                with contextlib.suppress(zmq.Again):  # a full queue: the liveness count decides
                    self._pump.send(self._codec.encode(m.Heartbeat()))
            await asyncio.sleep(interval)
            if self._resume is not None:
                live.heard()  # the resume has a deadline of its own
            elif not live.tick():
                silent = f"the coordinator at {self.address} has not answered for {liveness} heartbeats"
                if self.reconnect_s <= 0:
                    err = CoordinatorLostError(f"{silent} ({interval * liveness:.1f} s); check that it is running")
                    self._dead = err
                    self._fail_all(err)
                    return
                self._start_resume(silent)

    def _fail_all(self, err: PlexError) -> None:
        pending, self._pending = self._pending, {}
        held, self._held = self._held, []
        for req in [*pending.values(), *held]:
            if not req.fut.done():
                req.fut.set_exception(type(err)(err.message))

    # -- resume ---------------------------------------------------------------------------------

    def _start_resume(self, why: str) -> None:
        if self._resume is None and self._dead is None:
            log.warning("%s: reconnecting (for up to %g s)", why, self.reconnect_s)
            self._resume = asyncio.create_task(self._resume_session(why), name="plexrl-client-resume")
            self._tasks.append(self._resume)

    async def _resume_session(self, why: str) -> None:
        """Say Hello again, reattach every open job, settle the calls the old session left
        unanswered, then send what was made meanwhile."""
        old = dict(self._pending)  # sent to the coordinator that forgot them
        held_jobs = set(self.jobs)
        others = [r for r in old.values() if not (isinstance(r.msg, m.Submit) and r.msg.job_id in held_jobs)]
        try:
            async with asyncio.timeout(self.reconnect_s):
                await self._request(m.Hello(client_name=self.name), expect(m.Welcome), resuming=True)
                if self._liveness is not None:
                    self._liveness.heard()
                for job in list(self.jobs.values()):
                    mine = [r for r in old.values() if isinstance(r.msg, m.Submit) and r.msg.job_id == job.job_id]
                    try:
                        again = m.Reattach(name=job.name, job_id=job.job_id)
                        done = await self._request(again, expect(m.Reattached), resuming=True)
                    except (UnknownJobError, UnknownClientError) as e:
                        if isinstance(e, UnknownClientError):
                            raise  # forgotten again (another restart): the next resume starts over
                        self.jobs.pop(job.job_id, None)
                        self._settle(mine, e)
                        continue
                    self._settle(mine, done)
                for req in others:  # requests that are not calls of the jobs above
                    if self._pending.get(req.rid) is not req or req.fut.done():
                        continue
                    if req.resuming:  # an earlier resume's, which gave up
                        self._drop(req)
                        req.fut.cancel()
                        continue
                    if isinstance(req.msg, m.StatusRequest | m.TraceRequest):
                        self._drop(req)
                        self._send(req)
                    elif isinstance(req.msg, m.OpenJob) and req.msg.token:
                        await self._reopen(req, req.msg)
                    else:
                        self._drop(req)
                        lost = f"{type(req.msg).__name__} was interrupted when {why}: do it again"
                        req.fut.set_exception(CoordinatorLostError(lost))
        except TimeoutError:
            err = CoordinatorLostError(
                f"{why}, and no coordinator answered within {self.reconnect_s:g} s (reconnect_s)"
            )
            self._dead = err
            self._fail_all(err)
            return
        except UnknownClientError:
            self._resume = None
            self._start_resume("the coordinator forgot this client again while it resumed")
            return
        finally:
            if self._resume is asyncio.current_task():
                self._resume = None
        log.warning("resumed: %d job(s) reattached", len(self.jobs))
        held, self._held = self._held, []
        for req in held:
            if not req.fut.done():
                self._send(req)

    async def _reopen(self, req: _Request, msg: m.OpenJob) -> None:
        """An opening the old coordinator left unanswered: the job it opened, if the opening
        finished (the journal has it, found by the opening's token), else a new opening."""
        self._drop(req)
        try:
            again = m.Reattach(name=msg.name, token=msg.token)
            done = await self._request(again, expect(m.Reattached), resuming=True)
        except UnknownJobError:
            self._send(req)  # it never finished opening: nothing of it exists
            return
        try:
            req.fut.set_result(req.unwrap(m.CallDone(job_id=done.job_id, result=done.opened)))
        except PlexError as e:
            req.fut.set_exception(e)

    def _settle(self, requests: list[_Request], outcome: m.Reattached | PlexError) -> None:
        """Settle a reattached job's unanswered calls by its commit point: a call it has not seen
        goes again (a generate also when only calls that left its sampler's weights alone came
        after it: same seed, same weights, same samples); the last call it holds gets the result
        the journal kept; an older one's result is lost (``ResultLostError``, saying whether it
        was applied). ``outcome`` an error: the job is gone, and so are its calls."""
        for req in sorted(requests, key=lambda r: r.msg.seq if isinstance(r.msg, m.Submit) else 0):
            if self._pending.get(req.rid) is not req or req.fut.done() or not isinstance(req.msg, m.Submit):
                continue
            self._drop(req)
            if isinstance(outcome, PlexError):
                req.fut.set_exception(type(outcome)(outcome.message))
                continue
            seq, kind = req.msg.seq, calls.CALL_KIND[type(req.msg.call)]
            after = outcome.weights_seq if kind == "generate" else outcome.committed_seq
            if seq > after:
                self._send(req)
            elif seq == outcome.committed_seq and outcome.committed is not None:
                done = m.CallDone(job_id=outcome.job_id, result=outcome.committed)
                try:
                    req.fut.set_result(req.unwrap(done))
                except PlexError as e:
                    req.fut.set_exception(e)
            else:
                applied = "was applied" if kind in STATEFUL_KINDS else "ran"
                req.fut.set_exception(
                    ResultLostError(
                        f"{kind} (call {seq} of job {outcome.job_id}) {applied} before the coordinator lost track "
                        f"of this client, and its result was lost; the job holds your calls up to "
                        f"{outcome.committed_seq}: go on from there"
                    )
                )


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
    reconnect_s: float = 120.0,
) -> Client:
    """Connect to a shared coordinator: ``async with plexrl.connect("tcp://head:7400"):``.

    ``credentials``: your client key, ``plexrl.Credentials.load("alice.key_secret", "coordinator.key")``;
    by default ``$PLEXRL_KEY`` and ``$PLEXRL_COORDINATOR_KEY`` name those two files.
    ``deadlines``: seconds per call kind before ``CallTimeoutError`` (defaults: ``DEADLINES_S``).
    ``reconnect_s``: how long to wait for a coordinator that went silent or restarted before
    failing every pending call (its jobs and calls resume if it comes back with its journal).
    """
    return Client(
        address, name=name, connect_timeout_s=connect_timeout_s, credentials=credentials, deadlines=deadlines,
        reconnect_s=reconnect_s,
    )  # fmt: skip


def job_shape(spec: calls.JobSpec, devices: int = 1) -> JobShape | None:
    """What the job trains, for the coordinator's memory plan; None if the model's config.json is not
    readable here (the model lives only on the workers' hosts: the job is then sized by its open)."""
    model = ModelShape.read(spec.model)
    if model is None:
        return None
    if spec.lora is None:
        return JobShape(model, checkpointing=spec.gradient_checkpointing, devices=devices)
    return JobShape(model, spec.lora.rank, spec.lora.target_modules, spec.gradient_checkpointing, devices)
