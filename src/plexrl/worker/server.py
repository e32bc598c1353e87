"""The worker process: registers with the coordinator, executes calls, heartbeats both ways.

The asyncio loop owns the DEALER socket and the heartbeats; the engine runs in one dedicated
thread, one call at a time, so a long training step never silences the heartbeat. If the
coordinator stops answering, the worker drops every job's state and registers again
(zguide's Paranoid Pirate), because the coordinator that comes back knows none of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from plexrl.errors import CallFailedError, PlexError
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Codec
from plexrl.protocol.liveness import Liveness

log = logging.getLogger("plexrl.worker")


class CallEngine(Protocol):
    """What the worker needs of an engine (the real one is ``plexrl.worker.engine.Engine``)."""

    def execute(self, job_id: str, call: calls.Call) -> calls.Result: ...


@dataclass
class WorkerConfig:
    coordinator: str
    device: str = "cpu"
    name: str = ""
    memory_budget_bytes: int = 8 << 30
    register_timeout_s: float = 60.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


class _CoordinatorLost(Exception):
    pass


class Worker:
    def __init__(self, config: WorkerConfig, make_engine: type[CallEngine] | None = None) -> None:
        self.config = config
        self._make_engine = make_engine
        self._codec: Codec[m.CoordinatorToWorker] = Codec(
            m.CoordinatorToWorker, max_bytes=config.max_message_bytes, copy_arrays=True
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-engine")
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    def _new_engine(self) -> CallEngine:
        if self._make_engine is not None:
            return self._make_engine()
        from plexrl.worker.engine import Engine

        return Engine(device=self.config.device)

    async def serve(self) -> None:
        """Register, serve, and register again whenever the coordinator is lost, until stopped."""
        engine = await asyncio.get_running_loop().run_in_executor(self._executor, self._new_engine)
        ctx = zmq.asyncio.Context()
        try:
            while not self._stopping.is_set():
                try:
                    await self._session(ctx, engine)
                except _CoordinatorLost as e:
                    log.info("coordinator lost (%s): dropping all job state and registering again", e)
                    engine = await asyncio.get_running_loop().run_in_executor(self._executor, self._new_engine)
        finally:
            ctx.term()
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _session(self, ctx: zmq.asyncio.Context, engine: CallEngine) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.connect(self.config.coordinator)
        try:
            reg = await self._register(sock)
            log.info("registered as %s with %s", reg.worker_id, self.config.coordinator)
            queue: asyncio.Queue[m.Execute] = asyncio.Queue()
            live = Liveness(reg.heartbeat_liveness)
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._receive_loop(sock, queue, live)),
                    tg.create_task(self._execute_loop(sock, queue, engine)),
                    tg.create_task(self._heartbeat_loop(sock, reg, live)),
                ]
                stop = tg.create_task(self._stopping.wait())
                _done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
                for t in [*tasks, stop]:
                    t.cancel()
        except ExceptionGroup as eg:
            lost = [e for e in eg.exceptions if isinstance(e, _CoordinatorLost)]
            if lost:
                raise lost[0] from None
            raise
        finally:
            sock.close(linger=0)

    async def _register(self, sock: zmq.asyncio.Socket) -> m.Registered:
        msg = m.Register(
            rid=1,
            name=self.config.name or f"{os.uname().nodename}:{os.getpid()}",
            device=self.config.device,
            engines=["hf"],
            memory_budget_bytes=self.config.memory_budget_bytes,
            pid=os.getpid(),
        )
        await sock.send_multipart(self._codec.encode(msg), copy=False)
        try:
            async with asyncio.timeout(self.config.register_timeout_s):
                while True:
                    reply = self._codec.decode(await sock.recv_multipart(copy=False))
                    if isinstance(reply, m.Registered):
                        return reply
        except TimeoutError:
            raise _CoordinatorLost(f"no answer to registration within {self.config.register_timeout_s} s") from None

    async def _receive_loop(self, sock: zmq.asyncio.Socket, queue: asyncio.Queue[m.Execute], live: Liveness) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            live.heard()
            try:
                msg = self._codec.decode(frames)
            except PlexError as e:
                log.error("dropping undecodable message from the coordinator: %s", e)
                continue
            if isinstance(msg, m.Execute):
                queue.put_nowait(msg)
            elif isinstance(msg, m.Shutdown):
                raise _CoordinatorLost(msg.reason)

    async def _execute_loop(
        self, sock: zmq.asyncio.Socket, queue: asyncio.Queue[m.Execute], engine: CallEngine
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ex = await queue.get()
            start = time.perf_counter()
            reply: m.CallDone | m.ErrorReply
            try:
                result = await loop.run_in_executor(self._executor, engine.execute, ex.job_id, ex.call)
                reply = m.CallDone(rid=ex.rid, job_id=ex.job_id, result=result, compute_s=time.perf_counter() - start)
            except PlexError as e:
                reply = m.ErrorReply(rid=ex.rid, code=e.code, message=e.message)
            except Exception as e:  # the engine failed this call; the worker and the job live on
                log.exception("call %d (%s) of job %s failed", ex.rid, calls.CALL_KIND[type(ex.call)], ex.job_id)
                err = CallFailedError(f"{calls.CALL_KIND[type(ex.call)]} failed on the worker: {type(e).__name__}: {e}")
                reply = m.ErrorReply(rid=ex.rid, code=err.code, message=err.message)
            try:
                frames = self._codec.encode(reply)
            except PlexError as e:
                frames = self._codec.encode(m.ErrorReply(rid=ex.rid, code=e.code, message=e.message))
            await sock.send_multipart(frames, copy=False)

    async def _heartbeat_loop(self, sock: zmq.asyncio.Socket, reg: m.Registered, live: Liveness) -> None:
        while True:
            await sock.send_multipart(self._codec.encode(m.Heartbeat()), copy=False)
            await asyncio.sleep(reg.heartbeat_interval_s)
            if not live.tick():
                raise _CoordinatorLost(f"no message from the coordinator for {live.liveness} heartbeats")


async def run_worker(config: WorkerConfig) -> None:
    """Serve until SIGINT or SIGTERM."""
    import signal

    worker = Worker(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    await worker.serve()
