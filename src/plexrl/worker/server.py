"""The worker process: registers with the coordinator, executes calls, heartbeats both ways.

The main thread owns the call socket and runs each call on the engine as it arrives, with no
hand-off between threads on the critical path. The one exception is sampling with vLLM: the
engine starts a ``generate`` and hands back a future, the main thread goes on serving, and the
reply goes out when the future completes (so many jobs' generates share vLLM's batches). Heartbeats go from a thread and a socket of their
own, so a long training step never silences the worker. If the coordinator stops answering (or
no longer knows this worker) the worker drops every job's state and registers again (zguide's
Paranoid Pirate), because the coordinator that comes back knows none of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np
import zmq

from plexrl.errors import CallAbortedError, CallFailedError, PlexError
from plexrl.names import EngineSleep
from plexrl.plan import WorkerPlan
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Codec
from plexrl.protocol.liveness import Liveness
from plexrl.worker.dataplane import DataPlane, host_toward

if TYPE_CHECKING:
    from plexrl.worker.memory import Moved
    from plexrl.worker.progress import Progress

log = logging.getLogger("plexrl.worker")
Frames = list[bytes | memoryview]

POLL_MS = 100  # how often an idle worker checks for stop and for a lost coordinator
VLLM_SLOTS = 64  # calls a vLLM worker accepts at once (generates overlap; other calls queue here)


class CallEngine(Protocol):
    """What the worker needs of an engine (the real one is ``plexrl.worker.engine.Engine``)."""

    progress: Progress  # ticked as its calls advance; the heartbeat reports it
    background_calls: tuple[str, ...]  # kinds its ``start`` runs beside other calls (they take no trainer slot)

    def start(self, job_id: str, call: calls.Call, priority: int = 0) -> Future[calls.Result] | None:
        """Start ``call`` in the background and return its future, or None to run it with
        ``execute``. Cancelling the future aborts the call."""
        ...

    def execute(self, job_id: str, call: calls.Call, gang: m.GangCall | None = None) -> calls.Result: ...

    def rendezvous(self) -> str:
        """The host:port of its store for the process groups of the gangs it leads."""
        ...

    def exclusive(self) -> AbstractContextManager[None]:
        """Sampling paused while inside (requests in flight are kept and go on after)."""
        ...

    def served_weights(self, job_id: str) -> tuple[int, dict[str, np.ndarray]]:
        """The weights the job's sampler serves now, and their version (to publish for other workers)."""
        ...

    def move(self, job_id: str, to: str) -> Moved:
        """Move the job's state to ``to`` (``device`` or ``host``); runs on the worker's move thread."""
        ...

    def move_engines(self, to: str, level: int) -> None:
        """Put its vLLM engines ``asleep`` at ``level`` or ``awake`` (the scheduler's ``MoveEngines``)."""
        ...

    def plan(self) -> WorkerPlan:
        """Its device's capacity and the settings the coordinator's memory plan needs."""
        ...

    def close(self) -> None:
        """Free everything (engine processes included); the engine is not used again."""
        ...


def default_sampler() -> str:
    """``$PLEXRL_SAMPLER``, else vllm where it is installed, else hf."""
    from plexrl.worker.sampler import vllm

    return os.environ.get("PLEXRL_SAMPLER") or ("vllm" if vllm.available() else "hf")


DEFAULT_CHECKPOINT_ROOT = os.path.join(
    os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "plexrl", "checkpoints"
)


@dataclass
class WorkerConfig:
    coordinator: str
    device: str = "cpu"
    name: str = ""
    memory_budget_bytes: int | None = None  # a cap on jobs' state on the device (None: what the plan leaves)
    register_timeout_s: float = 60.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    sampler: str = "hf"  # "vllm" | "hf"
    max_lora_rank: int = 8  # vLLM only: the largest LoRA rank its jobs may use
    max_loras: int = 32  # vLLM only: adapters one batch may mix
    max_num_seqs: int | None = None  # vLLM only: sequences decoded at once (None: vLLM's default)
    dtype: str = "auto"  # the compute dtype (auto: bfloat16 on a GPU, float32 on CPU)
    gpu_memory_utilization: float = 0.3  # vLLM on CUDA: each engine's reservation, a share of the GPU
    engine_sleep: EngineSleep = "auto"  # vLLM: whether its engines sleep while it trains (names.EngineSleep)
    max_model_len: int = 8192  # vLLM only: the longest prompt + completion (capped at the model's context)
    max_tokens_per_microbatch: int = 8192  # the trainer's padded tokens per forward/backward
    deterministic: bool = False  # torch's deterministic algorithms on CUDA (vLLM's batch invariance: the CLI's env)
    credentials: auth.Credentials | None = None  # a worker key (CurveZMQ); None: an unauthenticated coordinator
    checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT  # jobs' save / load paths are relative to root/<tenant>
    role: str = "both"  # "rollout" | "train" | "both" (the coordinator's events.ROLES)
    bucket: int = 0  # a rollout worker's bucket (the lowest trajectory level it serves)
    data_host: str | None = None  # the address its data plane serves weights on (None: toward the coordinator)
    # Where it sits, for jobs on several workers: its host and device index there ("": one-device
    # jobs only). Its gangs' rendezvous store listens on its data host.
    node: str = ""
    index: int = 0


EXIT_HUNG = 75  # the exit status of a worker declared hung (EX_TEMPFAIL: a supervisor starts it again)


class _CoordinatorLost(Exception):
    def __init__(self, reason: str, exit: bool = False) -> None:
        super().__init__(reason)
        self.exit = exit  # declared hung: exit rather than register again


def _exit_hung(reason: str) -> None:
    """Leave at once, engine processes included: the engine is wedged, so closing it could hang too."""
    children = [
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]  # fmt: skip
    log.critical("exiting: %s (killing engine processes %s)", reason, children)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(EXIT_HUNG)


class Worker:
    """``Worker(config).serve()`` blocks until :meth:`stop` (safe from a signal handler)."""

    def __init__(self, config: WorkerConfig, make_engine: type[CallEngine] | None = None) -> None:
        self.config = config
        self._make_engine = make_engine
        self._codec: Codec[m.CoordinatorToWorker] = Codec(
            m.CoordinatorToWorker, max_bytes=config.max_message_bytes, copy_arrays=True
        )
        self._stopping = threading.Event()
        # Background work (vLLM generates, state moves) finishes on other threads: the replies to
        # send queue here (built on the main thread) and a byte on the pipe wakes its poll. Each
        # carries the session it answers: one for a coordinator that is gone is dropped, never sent
        # to the next (whose call ids mean other calls).
        self._finished: queue.SimpleQueue[tuple[int, Callable[[], Frames]]] = queue.SimpleQueue()
        self._session_no = 0  # the registration now serving: one per coordinator session
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._running: dict[int, Future[calls.Result]] = {}  # background calls by request id
        # A job being opened in the background, and the calls for it that came meanwhile: they run
        # in arrival order once its open is answered (a job's calls never overtake its open).
        self._opening: dict[str, list[m.Execute]] = {}
        self._opened: list[m.Execute] = []  # those now due, run by the main thread's loop
        # State moves run one at a time beside the calls (the scheduler never moves a job that runs).
        self._moves = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-move")

    def stop(self) -> None:
        self._stopping.set()

    def _new_engine(self, host: str) -> CallEngine:
        """An engine whose gangs' rendezvous store listens on ``host`` (the data plane's)."""
        if self._make_engine is not None:
            return self._make_engine()
        from plexrl.worker.engine import Engine
        from plexrl.worker.sampler.vllm import VllmConfig
        from plexrl.worker.trainer.forward import TrainerSettings, worker_dtype

        vllm = VllmConfig(
            max_loras=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            max_num_seqs=self.config.max_num_seqs,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            engine_sleep=self.config.engine_sleep,
            max_model_len=self.config.max_model_len,
        )
        trainer = TrainerSettings(
            dtype=worker_dtype(self.config.dtype, self.config.device),
            max_tokens_per_microbatch=self.config.max_tokens_per_microbatch,
        )
        if self.config.deterministic and self.config.device.startswith("cuda"):
            import torch

            torch.use_deterministic_algorithms(True)
        return Engine(
            device=self.config.device,
            sampler=self.config.sampler,
            vllm_config=vllm,
            checkpoint_root=self.config.checkpoint_root,
            trainer=trainer,
            rendezvous_host=host,
        )

    def serve(self) -> None:
        """Register, serve, and register again whenever the coordinator is lost, until stopped."""
        # Found once: while the coordinator is unreachable (its route gone), a new engine still needs it.
        host = self.config.data_host or host_toward(self.config.coordinator)
        engine = self._new_engine(host)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._data = DataPlane(ctx, host, self.config.credentials)
        log.info("data plane at %s", self._data.address)
        try:
            while not self._stopping.is_set():
                try:
                    self._session(ctx, engine)
                except _CoordinatorLost as e:
                    if e.exit:
                        _exit_hung(f"the coordinator declared this worker hung ({e})")
                    log.info("coordinator lost (%s): dropping all job state and registering again", e)
                    self._opening.clear()
                    self._opened.clear()
                    self._data.clear()
                    engine.close()
                    engine = self._new_engine(host)
        finally:
            self._moves.shutdown(wait=True)
            self._data.close()
            engine.close()
            ctx.term()

    def _session(self, ctx: zmq.Context[zmq.Socket[bytes]], engine: CallEngine) -> None:
        sock = ctx.socket(zmq.DEALER)
        ident = os.urandom(8)
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        if self.config.credentials is not None:
            self.config.credentials.apply(sock)
        sock.connect(self.config.coordinator)
        self._session_no += 1
        self._running.clear()  # a lost session's background calls answer nobody now
        try:
            reg = self._register(sock, engine)
            log.info("registered as %s with %s", reg.worker_id, self.config.coordinator)
            beat = _Heartbeat(ctx, self.config, ident, reg, engine.progress)
            beat.start()
            try:
                self._serve_calls(sock, engine, beat)
            finally:
                beat.stop()
        finally:
            sock.close(linger=0)

    def _register(self, sock: zmq.Socket[bytes], engine: CallEngine) -> m.Registered:
        msg = m.Register(
            rid=1,
            name=self.config.name or f"{os.uname().nodename}:{os.getpid()}",
            device=self.config.device,
            engines=[self.config.sampler],
            memory_budget_bytes=self.config.memory_budget_bytes or 0,
            pid=os.getpid(),
            slots=VLLM_SLOTS if self.config.sampler == "vllm" else 1,
            trainer_slots=1,  # every call but a vLLM generate runs on the main thread, one at a time
            role=self.config.role,
            bucket=self.config.bucket,
            stateless_generates=self.config.sampler == "vllm",  # vLLM holds its own adapters (engine.py)
            plan=engine.plan(),
            background_calls=list(engine.background_calls),
            node=self.config.node,
            index=self.config.index,
            rendezvous=engine.rendezvous() if self.config.node else "",
        )
        sock.send_multipart(self._codec.encode(msg), copy=False)
        deadline = time.monotonic() + self.config.register_timeout_s
        while not self._stopping.is_set() and time.monotonic() < deadline:
            if sock.poll(POLL_MS):
                reply = self._codec.decode(sock.recv_multipart(copy=False))
                if isinstance(reply, m.Registered):
                    return reply
        raise _CoordinatorLost(f"no answer to registration within {self.config.register_timeout_s} s")

    def _serve_calls(self, sock: zmq.Socket[bytes], engine: CallEngine, beat: _Heartbeat) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stopping.is_set():
            if beat.lost:
                raise _CoordinatorLost(beat.lost, exit=beat.exit)
            ready = dict(poller.poll(POLL_MS))
            if self._wake_r in ready:
                self._send_finished(sock)
            while self._opened:
                self._execute(sock, engine, self._opened.pop(0))
            if sock not in ready:
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                msg = self._codec.decode(frames)
            except PlexError as e:
                log.error("dropping undecodable message from the coordinator: %s", e)
                continue
            if isinstance(msg, m.Execute):
                self._execute(sock, engine, msg)
            elif isinstance(msg, m.MoveState):
                self._start_move(engine, msg)
            elif isinstance(msg, m.MoveEngines):
                sock.send_multipart(self._move_engines(engine, msg), copy=False)
            elif isinstance(msg, m.Abort) and msg.rid in self._running:
                self._running[msg.rid].cancel()  # its done callback sends the CallAbortedError
            elif isinstance(msg, m.Abort):
                self._abort_waiting(sock, msg.rid)
            elif isinstance(msg, m.Shutdown):
                raise _CoordinatorLost(msg.reason, exit=msg.exit)

    def _execute(self, sock: zmq.Socket[bytes], engine: CallEngine, ex: m.Execute) -> None:
        if ex.job_id in self._opening:  # its open runs in the background: after it
            self._opening[ex.job_id].append(ex)
            return
        start = time.perf_counter()
        try:  # a gang's call runs in step with its other members: on the main thread, in order
            background = engine.start(ex.job_id, ex.call, ex.priority) if ex.gang is None else None
        except Exception as e:  # rejected before it started: reply now
            rejected: Future[calls.Result] = Future()
            rejected.set_exception(e)
            sock.send_multipart(self._reply(ex, start, functools.partial(_outcome, rejected)), copy=False)
            return
        if background is None:
            run = functools.partial(self._run, engine, ex.job_id, ex.call, ex.exclusive, ex.gang)
            sock.send_multipart(self._reply(ex, start, run), copy=False)
        else:
            self._running[ex.rid] = background
            if isinstance(ex.call, calls.Open):
                self._opening[ex.job_id] = []
            session = self._session_no
            background.add_done_callback(
                lambda f: self._later(functools.partial(self._finished_call, ex, start, f), session)
            )

    def _abort_waiting(self, sock: zmq.Socket[bytes], rid: int) -> None:
        """Abort a call still waiting for its job's open: it is answered at once, never run."""
        for waiting in self._opening.values():
            for ex in [ex for ex in waiting if ex.rid == rid]:
                waiting.remove(ex)
                aborted: Future[calls.Result] = Future()
                aborted.cancel()
                sock.send_multipart(self._reply(ex, time.perf_counter(), functools.partial(_outcome, aborted)))

    def _run(
        self, engine: CallEngine, job_id: str, call: calls.Call, exclusive: bool = False, gang: m.GangCall | None = None
    ) -> calls.Result:
        """Run ``call`` on the engine, with the data plane around it: weights a ``SetWeights``
        names are fetched from the worker serving them first; weights a call exports are
        published here after, and the coordinator hears where. ``exclusive``: sampling pauses
        meanwhile."""
        match call:
            case calls.SetWeights(source=source) if source is not None:
                call = msgspec.structs.replace(call, tensors=self._data.fetch(source), source=None)
            case calls.Close():
                self._data.forget(job_id)
        received = time.time()  # a SetWeights' tensors are in memory now (inline ones came with the call)
        with engine.exclusive() if exclusive else contextlib.nullcontext():
            result = engine.execute(job_id, call, gang)
        match call, result:
            case calls.SetWeights(exported_at=exported), calls.Synced() if exported:
                return msgspec.structs.replace(result, push_s=max(0.0, received - exported))
            case calls.SyncWeights(export=True, inline=False), calls.Synced(weight_version=v, tensors=t) if (
                t is not None
            ):
                source = self._data.publish(job_id, v, t)
                return calls.Synced(weight_version=v, source=source, exported_at=time.time())
            case calls.SyncWeights(inline=True), calls.Synced(tensors=t) if t is not None:
                return msgspec.structs.replace(result, exported_at=time.time())
            case calls.Load(export=True), calls.Loaded(weight_version=v, tensors=t) if t is not None:
                return msgspec.structs.replace(result, tensors=None, source=self._data.publish(job_id, v, t))
            case calls.Restore(export=True), calls.Opened():
                version, tensors = engine.served_weights(job_id)
                return msgspec.structs.replace(result, source=self._data.publish(job_id, version, tensors))
        return result

    def _move_engines(self, engine: CallEngine, msg: m.MoveEngines) -> Frames:
        """Sleep or wake the engines, on this thread (no call that uses them runs meanwhile)."""
        start = time.perf_counter()
        try:
            engine.move_engines(msg.to, msg.level)
            error = ""
        except Exception as e:  # the coordinator takes them to be awake and sleeps them no more
            log.exception("putting the engines %s failed", msg.to)
            error = f"{type(e).__name__}: {e}"
        done = m.EnginesMoved(rid=msg.rid, to=msg.to, seconds=time.perf_counter() - start, error=error)
        return self._codec.encode(done)

    def _start_move(self, engine: CallEngine, msg: m.MoveState) -> None:
        move = self._moves.submit(engine.move, msg.job_id, msg.to)
        session = self._session_no
        move.add_done_callback(lambda f: self._later(functools.partial(self._moved, msg, f), session))

    def _later(self, reply: Callable[[], Frames], session: int) -> None:
        """From any thread: have the main thread build and send ``reply()``, if ``session`` (the
        one the call came in) is still the one serving."""
        self._finished.put((session, reply))
        os.write(self._wake_w, b"\0")

    def _finished_call(self, ex: m.Execute, start: float, fut: Future[calls.Result]) -> Frames:
        self._running.pop(ex.rid, None)
        if isinstance(ex.call, calls.Open):
            self._opened += self._opening.pop(ex.job_id, [])  # run after this reply goes out
        return self._reply(ex, start, functools.partial(_outcome, fut))

    def _moved(self, msg: m.MoveState, fut: Future[Moved]) -> Frames:
        try:
            done = fut.result()
            reply = m.StateMoved(rid=msg.rid, job_id=msg.job_id, to=done.to, bytes=done.bytes, seconds=done.seconds)
        except Exception as e:  # the state stayed where it was; the coordinator hears why
            log.exception("moving job %s's state to %s failed", msg.job_id, msg.to)
            reply = m.StateMoved(rid=msg.rid, job_id=msg.job_id, to=msg.to, bytes=0, seconds=0.0, error=f"{e}")
        return self._codec.encode(reply)

    def _send_finished(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                break
        while True:
            try:
                session, reply = self._finished.get_nowait()
            except queue.Empty:
                return
            if session == self._session_no:
                sock.send_multipart(reply(), copy=False)
            else:
                log.info("dropping a reply for a lost coordinator session")

    def _reply(self, ex: m.Execute, start: float, outcome: Callable[[], calls.Result]) -> Frames:
        """The encoded reply to one call: its result, or a typed error (the worker lives on)."""
        kind = calls.CALL_KIND[type(ex.call)]
        reply: m.CallDone | m.ErrorReply
        try:
            result = outcome()
            reply = m.CallDone(rid=ex.rid, job_id=ex.job_id, result=result, compute_s=time.perf_counter() - start)
        except PlexError as e:
            reply = m.ErrorReply(rid=ex.rid, code=e.code, message=e.message)
        except Exception as e:  # the engine failed this call; the worker and the job live on
            log.exception("call %d (%s) of job %s failed", ex.rid, kind, ex.job_id)
            err = CallFailedError(f"{kind} failed on the worker: {type(e).__name__}: {e}")
            reply = m.ErrorReply(rid=ex.rid, code=err.code, message=err.message)
        try:
            return self._codec.encode(reply)
        except PlexError as e:  # e.g. a result over the message size limit
            return self._codec.encode(m.ErrorReply(rid=ex.rid, code=e.code, message=e.message))


def _outcome(fut: Future[calls.Result]) -> calls.Result:
    if fut.cancelled():
        raise CallAbortedError("the call was aborted before it finished")
    return fut.result()


class _Heartbeat(threading.Thread):
    """Heartbeats on a socket of its own; sets ``lost`` (a reason) once the coordinator is gone."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: WorkerConfig,
        call_ident: bytes,
        reg: m.Registered,
        progress: Progress,
    ) -> None:
        super().__init__(name="plexrl-heartbeat", daemon=True)
        self._ctx, self._config, self._call_ident, self._reg = ctx, config, call_ident, reg
        self._progress = progress
        self.exit = False  # told to exit (declared hung)
        self._codec: Codec[m.CoordinatorToWorker] = Codec(m.CoordinatorToWorker)
        self._stopping = threading.Event()
        self.lost = ""

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._config.credentials is not None:
            self._config.credentials.apply(sock)
        sock.connect(self._config.coordinator)
        interval, live = self._reg.heartbeat_interval_s, Liveness(self._reg.heartbeat_liveness)
        try:
            while not self._stopping.is_set():
                beat = m.Heartbeat(worker=self._call_ident, progress=self._progress.value)
                sock.send_multipart(self._codec.encode(beat), copy=False)
                deadline = time.monotonic() + interval
                while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
                    if sock.poll(max(1, min(POLL_MS, int(left * 1000)))):
                        live.heard()
                        msg = self._codec.decode(sock.recv_multipart(copy=False))
                        if isinstance(msg, m.Shutdown):
                            self.lost, self.exit = msg.reason, msg.exit
                            # The main thread stops the session within a poll, unless a wedged call holds it.
                            if msg.exit and not self._stopping.wait(interval * live.liveness):
                                _exit_hung(f"declared hung ({msg.reason}) while a call still runs")
                            return
                if not live.tick():
                    self.lost = f"no message from the coordinator for {live.liveness} heartbeats"
                    return
        finally:
            sock.close(linger=0)


def run_worker(config: WorkerConfig) -> None:
    """Serve until SIGINT or SIGTERM (the call in progress, if any, finishes first)."""
    worker = Worker(config)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: worker.stop())
    worker.serve()
