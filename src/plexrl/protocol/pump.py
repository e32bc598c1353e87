"""A ZeroMQ socket driven by asyncio reader callbacks: each message is handled as it is drained.

``zmq.asyncio`` makes a future and a task wake-up per message; on a busy 2-core VM that cost
more than the wire itself. A pump instead registers the socket's file descriptor with the loop
and, whenever it is readable, drains every waiting message into ``on_frames`` synchronously.
Sends are non-blocking and immediate. ZeroMQ's descriptor is edge-triggered, so after every
send the pump checks for input that arrived meanwhile (the descriptor would not fire for it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import zmq

log = logging.getLogger("plexrl.protocol")

Frames = list[zmq.Frame]


class Pump:
    """Owns one socket on the running loop; ``close()`` unregisters and closes it."""

    def __init__(self, sock: zmq.Socket[bytes], on_frames: Callable[[Frames], None]) -> None:
        self.sock = sock
        self._on_frames = on_frames
        self._loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._drain_pending = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # messages may have arrived before the reader was registered

    def send(self, frames: Sequence[bytes | zmq.Frame | memoryview]) -> None:
        """Queue ``frames`` now; raises ``zmq.Again`` at the high-water mark and ``zmq.ZMQError``
        (EHOSTUNREACH) for an unknown ROUTER peer."""
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        finally:
            self._schedule_drain()

    def close(self) -> None:
        if not self.sock.closed:
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=0)

    def _schedule_drain(self) -> None:
        if not self._drain_pending:
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_pending = False
        while not self.sock.closed and int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            try:
                self._on_frames(frames)
            except Exception:  # one bad message must not stop the socket being served
                log.exception("unhandled error while handling a message")
