"""Many tenants' LoRA adapters on one sampling engine: which versions it holds, and when one may go.

Every published adapter version gets an immutable name, ``{job}@v{version}``, and an id of its
own, so nothing keyed on the name (vLLM's prefix cache) can mix two versions. A request holds a
reference to the version it samples with from admission to its end. A version is unloaded when
it is both superseded (a newer one was published, or its job closed) and unreferenced, never
while a request uses it (the failure of vLLM #14497 and TRL #7017). Current versions are loaded
on demand and, beyond ``max_loaded``, the least recently used unreferenced one is unloaded (its
weights stay here, in memory, so it loads again on its next request).

:class:`FairAdmission` sits in front of the engine: vLLM batches at most ``max_loras`` adapters
per step and lets requests whose adapter is resident jump the queue, which can starve the others
(vLLM #16876). Requests here are admitted in arrival order, at most ``max_active`` distinct
adapters at once; a request whose adapter is already active goes straight in only while nobody
waits, so every waiting tenant reaches the engine within the time its predecessors take.

Both are used from one asyncio loop (the sampler's thread) and touch the engine only through
:class:`AdapterEngine`, so the tests drive them with a fake engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter version's weights, in memory: what the engine loads it from (never a file)."""

    tensors: bytes  # a safetensors blob, PEFT's saved layout, in the engine's dtype
    config: dict[str, Any]  # its PEFT LoraConfig as a dict (adapter_config.json's contents)


@dataclass(eq=False)
class AdapterVersion:
    key: str  # the job whose adapter it is
    version: int
    lora_id: int  # fresh for every version
    weights: AdapterWeights | None  # None once superseded and unloaded: it never loads again
    refs: int = 0  # requests using it now
    loaded: bool = False  # in the engine
    superseded: bool = False  # a newer version exists, or its job closed
    last_used: int = 0  # when a request last acquired it (a tick of the registry)

    @property
    def name(self) -> str:
        return f"{self.key}@v{self.version}"


class AdapterEngine(Protocol):
    """What the registry needs of an engine (vLLM's ``add_lora`` / ``remove_lora``)."""

    async def load(self, adapter: AdapterVersion) -> None: ...
    async def unload(self, adapter: AdapterVersion) -> None: ...


class AdapterRegistry:
    def __init__(self, engine: AdapterEngine, max_loaded: int) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded={max_loaded} must be >= 1")
        self.engine = engine
        self.max_loaded = max_loaded
        self._current: dict[str, AdapterVersion] = {}
        self._versions: set[AdapterVersion] = set()  # every version not yet deleted
        self._ids = itertools.count(1)
        self._tick = itertools.count(1)

    def __contains__(self, key: str) -> bool:
        return key in self._current

    def current(self, key: str) -> AdapterVersion | None:
        return self._current.get(key)

    @property
    def loaded(self) -> list[AdapterVersion]:
        return sorted((v for v in self._versions if v.loaded), key=lambda v: v.lora_id)

    async def publish(self, key: str, version: int, weights: AdapterWeights) -> AdapterVersion:
        """``key``'s adapter is ``version`` (``weights``) from now on; loaded on first use."""
        adapter = AdapterVersion(key, version, next(self._ids), weights)
        old = self._current.get(key)
        self._current[key] = adapter
        self._versions.add(adapter)
        if old is not None:
            await self._supersede(old)
        return adapter

    async def drop(self, key: str) -> None:
        """The job closed: its adapter goes once its last request ends."""
        old = self._current.pop(key, None)
        if old is not None:
            await self._supersede(old)

    async def acquire(self, key: str) -> AdapterVersion:
        """The current version of ``key``'s adapter, loaded and referenced (``release`` it after)."""
        adapter = self._current[key]
        adapter.refs += 1
        adapter.last_used = next(self._tick)
        if not adapter.loaded:
            try:
                await self._make_room()
                await self.engine.load(adapter)
            except BaseException:
                adapter.refs -= 1
                raise
            adapter.loaded = True
        return adapter

    async def release(self, adapter: AdapterVersion) -> None:
        if adapter.refs <= 0:
            raise RuntimeError(f"adapter {adapter.name} released more often than acquired")
        adapter.refs -= 1
        if adapter.superseded and adapter.refs == 0:
            await self._delete(adapter)

    async def _supersede(self, adapter: AdapterVersion) -> None:
        adapter.superseded = True
        if adapter.refs == 0:
            await self._delete(adapter)

    async def _make_room(self) -> None:
        """Unload least recently used idle adapters until one more fits (in-use ones stay, so the
        engine may briefly hold more than ``max_loaded`` when every loaded one is in use)."""
        while len(self.loaded) >= self.max_loaded:
            idle = [v for v in self.loaded if v.refs == 0]
            if not idle:
                return
            victim = min(idle, key=lambda v: v.last_used)
            await self.engine.unload(victim)
            victim.loaded = False

    async def _delete(self, adapter: AdapterVersion) -> None:
        if adapter.loaded:
            await self.engine.unload(adapter)
            adapter.loaded = False
        adapter.weights = None
        self._versions.discard(adapter)


class FairAdmission:
    """Arrival-order admission with at most ``max_active`` distinct keys (adapters) in flight."""

    def __init__(self, max_active: int) -> None:
        if max_active < 1:
            raise ValueError(f"max_active={max_active} must be >= 1")
        self.max_active = max_active
        self.in_flight: dict[str, int] = {}  # key -> its admitted, unfinished requests
        self._queue: deque[tuple[str, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def admit(self, key: str) -> None:
        """Wait for ``key``'s turn; every ``admit`` is paired with one ``done`` (also on error)."""
        if not self._queue and self._fits(key):
            self._start(key)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((key, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # admitted just as it was cancelled: give it back
                self.done(key)
            else:
                if (key, turn) in self._queue:  # not already skipped by _advance
                    self._queue.remove((key, turn))
                self._advance()
            raise

    def done(self, key: str) -> None:
        left = self.in_flight[key] - 1
        if left:
            self.in_flight[key] = left
        else:
            del self.in_flight[key]
        self._advance()

    def _fits(self, key: str) -> bool:
        return key in self.in_flight or len(self.in_flight) < self.max_active

    def _start(self, key: str) -> None:
        self.in_flight[key] = self.in_flight.get(key, 0) + 1

    def _advance(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            key, turn = self._queue.popleft()
            if turn.cancelled():
                continue
            self._start(key)
            turn.set_result(None)
