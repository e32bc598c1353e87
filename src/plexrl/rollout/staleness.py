"""Staleness-bounded admission for asynchronous RL (AReaL's rule), client side.

An asynchronous job keeps sampling while it trains, so some samples come from older weights.
A job opened with ``max_staleness=k`` trains on samples at most ``k`` versions old (the trainer
refuses older ones with ``StaleSamplesError``); this gate keeps the producers from getting that
far ahead. A new sample may start only while

    in_flight + accepted + 1 <= (k + version + 1) * batch_size

where ``accepted`` counts every sample ever accepted for training (never decremented when the
trainer consumes it) and ``version`` is the trainer's published weight version. With ``k = 0``
a job samples exactly one batch per version: synchronous RL.

    gate = StalenessGate(max_staleness=2, batch_size=64)
    async def producer():
        while True:
            await gate.admit()
            traj = ...                            # sample and score one trajectory
            gate.finish(accepted=keep(traj))      # a filtered sample frees its slot, counts nothing
    # trainer, after each sync_weights:
    gate.publish(synced.weight_version)
"""

from __future__ import annotations

import asyncio

from plexrl.errors import InvalidRequestError


class StalenessGate:
    def __init__(self, max_staleness: int, batch_size: int, version: int = 0) -> None:
        if max_staleness < 0 or batch_size < 1:
            raise InvalidRequestError(
                f"StalenessGate needs max_staleness >= 0 and batch_size >= 1 (got {max_staleness}, {batch_size})"
            )
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.version = version
        self.in_flight = 0
        self.accepted = version * batch_size  # as if every earlier version had trained on a full batch
        self._changed = asyncio.Event()  # set whenever the counts or the version change

    @property
    def capacity(self) -> int:
        """How many samples may have been started (in flight or accepted) at this version."""
        return (self.max_staleness + self.version + 1) * self.batch_size

    def can_admit(self) -> bool:
        return self.in_flight + self.accepted + 1 <= self.capacity

    async def admit(self, timeout_s: float | None = None) -> int:
        """Wait until one more sample may start, count it in flight, and return the version it
        will (at the earliest) be sampled with. ``TimeoutError`` after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not self.can_admit():
                self._changed.clear()
                await self._changed.wait()
        self.in_flight += 1  # no await between the check and this: one event loop thread
        return self.version

    def finish(self, accepted: bool = True) -> None:
        """A sample admitted earlier is done: ``accepted`` for training, or filtered out."""
        if self.in_flight == 0:
            raise InvalidRequestError("StalenessGate.finish() without a matching admit()")
        self.in_flight -= 1
        self.accepted += int(accepted)
        self._notify()

    def discard(self) -> None:
        """An accepted sample will not be trained on after all (it was too stale by the time the
        trainer got to it): it no longer counts, so a producer may start one in its place."""
        if self.accepted <= 0:
            raise InvalidRequestError("StalenessGate.discard() without an accepted sample")
        self.accepted -= 1
        self._notify()

    def publish(self, version: int) -> None:
        """The trainer published ``version``: producers may run ahead of it again."""
        if version < self.version:
            raise InvalidRequestError(f"weight version went back from {self.version} to {version}")
        self.version = version
        self._notify()

    def recover(self, version: int) -> None:
        """After loading a checkpoint of ``version``: count it as trained on full batches (AReaL's
        ``on_version_recovered``; without it the producers would burst)."""
        self.version = version
        self.accepted = version * self.batch_size
        self._notify()

    def _notify(self) -> None:
        self._changed.set()  # every waiter wakes and checks again
