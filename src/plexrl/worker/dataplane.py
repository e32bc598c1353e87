"""Weights between workers: each worker serves the weights its jobs published and fetches others' directly.

A job whose sampler runs on other workers (a disaggregated job's sampler worker, a pooled job's
rollout workers) publishes its weights at every ``sync_weights`` on its home worker's data
plane: a ZeroMQ ROUTER socket served by a thread of its own, so a worker busy training still
answers. The coordinator hears only a :class:`~plexrl.protocol.calls.WeightSource` (address,
key, a one-time token, size) and passes it on in ``SetWeights``; the sampler worker fetches the
tensors from the home worker in one request, the arrays travelling as zero-copy frames. Weights
never go through the coordinator, so its socket and its 64 MiB message limit carry only calls.

With keys (``plexrl keys``) the data socket is a CurveZMQ server with the worker's own key pair:
the traffic is encrypted, and a request is answered only if it carries the token of the version
it asks for, which only the coordinator and the job's workers hear. Without keys a cluster is
loopback-only (``auth.check_insecure_bind``), and so is the data plane. A worker on the same host
(the same data address) fetches over a Unix socket instead, in a folder of mode 0700 that only
this user's processes can open: nothing crosses a network, so nothing needs encrypting, which on
CPU halves the cost of a same-host push.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from plexrl.errors import CallFailedError, PlexError
from plexrl.protocol import auth
from plexrl.protocol import messages as m
from plexrl.protocol.calls import WeightSource
from plexrl.protocol.codec import Codec

log = logging.getLogger("plexrl.worker.dataplane")

KEPT_VERSIONS = 2  # per job: the newest, and the one before (a fetch sent just before a sync still finds it)
REQUEST_BYTES = 1 << 16  # the most a fetch request may be
POLL_MS = 100
FETCH_BASE_S = 10.0  # a fetch's deadline: this, plus its bytes at FETCH_MIN_BYTES_PER_S
FETCH_MIN_BYTES_PER_S = 50e6


def host_toward(endpoint: str) -> str:
    """This machine's address on the route to ``endpoint`` (tcp://HOST:PORT): the address its
    peers reach it at, since they reach the same coordinator. Loopback for a loopback endpoint."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise CallFailedError(f"cannot resolve the coordinator's host {host!r}: {e}") from e
    if ipaddress.ip_address(addr[0]).is_loopback:
        return "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: this only picks the route
        probe.connect(addr)
        local = str(probe.getsockname()[0])
    return f"[{local}]" if ":" in local else local


@dataclass(frozen=True)
class _Published:
    version: int
    token: bytes
    tensors: dict[str, np.ndarray]


class DataPlane:
    """One worker's end of the data plane: ``publish`` weights for others, ``fetch`` others'."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, credentials: auth.Credentials | None = None
    ) -> None:
        if credentials is None:
            auth.check_insecure_bind(f"tcp://{host}:0")  # weights readable by anyone who can reach it
        self._ctx, self._credentials = ctx, credentials
        self._published: dict[str, list[_Published]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        sock = self._router()
        if credentials is not None:
            sock.curve_server = True
            sock.curve_secretkey = credentials.pair.secret
            sock.curve_publickey = credentials.pair.public
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._folder = tempfile.mkdtemp(prefix="plexrl-data-")  # mode 0700
        local = self._router()
        self.local_address = f"ipc://{self._folder}/weights"
        local.bind(self.local_address)
        self._thread = threading.Thread(target=self._serve, args=(sock, local), name="plexrl-dataplane", daemon=True)
        self._thread.start()

    def _router(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)
        return sock

    # -- serving -------------------------------------------------------------------------------

    def publish(self, job_id: str, version: int, tensors: dict[str, np.ndarray]) -> WeightSource:
        """Serve ``tensors`` as ``job_id``'s weights ``version`` (they must not change afterwards)."""
        entry = _Published(version, os.urandom(16), {k: np.ascontiguousarray(t) for k, t in tensors.items()})
        with self._lock:
            kept = [p for p in self._published.get(job_id, []) if p.version != version]
            self._published[job_id] = [*kept, entry][-KEPT_VERSIONS:]
        key = self._credentials.pair.public if self._credentials is not None else b""
        nbytes = sum(t.nbytes for t in entry.tensors.values())
        return WeightSource(self.address, key, job_id, version, entry.token, nbytes, local=self.local_address)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._published.pop(job_id, None)

    def clear(self) -> None:
        with self._lock:
            self._published.clear()

    def _find(self, req: m.FetchWeights) -> _Published:
        with self._lock:
            kept = list(self._published.get(req.job_id, []))
        for p in kept:
            if p.version == req.weight_version and hmac.compare_digest(p.token, req.token):
                return p
        newest = f" (it serves version {kept[-1].version})" if kept else ""
        raise CallFailedError(
            f"job {req.job_id!r}'s weights version {req.weight_version} are not published on this worker{newest}"
        )

    def _serve(self, *socks: zmq.Socket[bytes]) -> None:
        requests: Codec[m.WorkerToWorker] = Codec(m.WorkerToWorker, max_bytes=REQUEST_BYTES)
        replies: Codec[m.WorkerToWorker] = Codec(m.WorkerToWorker, max_bytes=1 << 62)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    self._answer(sock, requests, replies)
        finally:
            for s in socks:
                s.close(linger=0)
            shutil.rmtree(self._folder, ignore_errors=True)

    def _answer(
        self, sock: zmq.Socket[bytes], requests: Codec[m.WorkerToWorker], replies: Codec[m.WorkerToWorker]
    ) -> None:
        ident, *frames = sock.recv_multipart(copy=False)
        reply: m.Weights | m.ErrorReply
        try:
            req = requests.decode(frames)
            if not isinstance(req, m.FetchWeights):
                raise CallFailedError(f"the data plane answers fetch_weights only, not {type(req).__name__}")
            reply = m.Weights(rid=req.rid, tensors=self._find(req).tensors)
        except PlexError as e:
            reply = m.ErrorReply(rid=int(getattr(e, "rid", 0)), code=e.code, message=e.message)
        try:
            sock.send_multipart([ident.bytes, *replies.encode(reply)], copy=False)
        except zmq.ZMQError as e:  # the fetcher left: nothing to answer
            log.debug("could not answer a fetch: %s", e)

    # -- fetching ------------------------------------------------------------------------------

    def fetch(self, source: WeightSource, timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """The weights ``source`` names, from the worker serving them; ``CallFailedError`` if it
        does not answer within ``timeout_s`` (default: 10 s plus 50 MB/s) or no longer has them."""
        if timeout_s is None:
            timeout_s = FETCH_BASE_S + source.nbytes / FETCH_MIN_BYTES_PER_S
        codec: Codec[m.WorkerToWorker] = Codec(
            m.WorkerToWorker, max_bytes=source.nbytes + REQUEST_BYTES, copy_arrays=True
        )  # the engine keeps them
        same_host = bool(source.local) and _host(source.address) == _host(self.address)
        if source.key and self._credentials is None and not same_host:
            raise CallFailedError(f"{source.address} serves weights with keys; start this worker with --key")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, source.nbytes + REQUEST_BYTES)
        if source.key and self._credentials is not None and not same_host:
            sock.curve_secretkey = self._credentials.pair.secret
            sock.curve_publickey = self._credentials.pair.public
            sock.curve_serverkey = source.key
        try:
            sock.connect(source.local if same_host else source.address)
            ask = m.FetchWeights(rid=1, job_id=source.job_id, weight_version=source.weight_version, token=source.token)
            sock.send_multipart(codec.encode(ask), copy=False)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, min(POLL_MS, int(left * 1000)))):
                    continue
                reply = codec.decode(sock.recv_multipart(copy=False))
                if isinstance(reply, m.Weights):
                    return reply.tensors
                if isinstance(reply, m.ErrorReply):
                    raise CallFailedError(f"fetching weights from {source.address}: {reply.message}")
            raise CallFailedError(
                f"no weights from {source.address} (job {source.job_id!r}, version {source.weight_version}) "
                f"within {timeout_s:.0f} s: is that worker alive and reachable from this host?"
            )
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)


def _host(address: str) -> str:
    """The host part of tcp://HOST:PORT."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]
