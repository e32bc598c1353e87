"""Tinker's futures: every mutating request is answered at once with a request id, and the SDK
polls ``retrieve_future`` for its outcome, which the gateway holds open up to ``poll_s`` (the SDK
asks again at once after a ``try_again``, so the poll must block, not return early)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from plexrl.errors import InvalidRequestError, PlexError

log = logging.getLogger("plexrl.gateway")

POLL_S = 25.0  # under the SDK's 45 s read timeout on retrieve_future
KEEP_S = 600.0  # an outcome is kept this long after it is ready (the SDK may ask again after a retry)


@dataclass(frozen=True)
class Json:
    body: dict[str, Any]


@dataclass(frozen=True)
class Proto:
    body: bytes


@dataclass(frozen=True)
class Failed:
    error: str
    category: str  # "user" | "server" | "unknown": the SDK's RequestErrorCategory values


Outcome = Json | Proto | Failed


def failed(e: BaseException) -> Failed:
    """A call's exception as the SDK reads it: plexrl's typed errors caused by the request are the
    user's, everything else the server's."""
    if isinstance(e, PlexError):
        return Failed(f"{e.code}: {e.message}", "user" if isinstance(e, InvalidRequestError) else "server")
    log.exception("a gateway request failed", exc_info=e)
    return Failed(f"{type(e).__name__}: {e}", "server")


class Futures:
    """Request ids and their outcomes."""

    def __init__(self, poll_s: float = POLL_S, keep_s: float = KEEP_S) -> None:
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._futures: dict[str, asyncio.Future[Outcome]] = {}
        self._owner: dict[str, str] = {}  # request id -> the API key that made it
        self._ready_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, owner: str, work: Awaitable[Outcome]) -> str:
        """Run ``work`` in the background; its outcome (or its exception, as ``Failed``) resolves the
        returned request id."""
        request_id = uuid.uuid4().hex
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._futures[request_id], self._owner[request_id] = future, owner

        async def run() -> None:
            try:
                outcome = await work
            except Exception as e:  # the request's failure is its outcome
                outcome = failed(e)
            future.set_result(outcome)
            self._ready_at[request_id] = time.monotonic()

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return request_id

    async def retrieve(self, owner: str, request_id: str) -> Outcome | None:
        """The outcome, or None if it is not ready within ``poll_s`` (the SDK asks again)."""
        future = self._futures.get(request_id)
        if future is None or self._owner.get(request_id) != owner:
            raise KeyError(request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.poll_s)
        except TimeoutError:
            return None

    def sweep(self) -> None:
        """Forget outcomes ready for longer than ``keep_s``."""
        cutoff = time.monotonic() - self.keep_s
        for request_id in [r for r, t in self._ready_at.items() if t < cutoff]:
            del self._ready_at[request_id], self._futures[request_id], self._owner[request_id]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
