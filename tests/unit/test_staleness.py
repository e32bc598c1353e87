"""AReaL's admission rule: in_flight + accepted + 1 <= (max_staleness + version + 1) * batch_size."""

from __future__ import annotations

import asyncio

import pytest

from plexrl.errors import InvalidRequestError
from plexrl.rollout import StalenessGate


async def admitted(gate: StalenessGate, n: int) -> int:
    """How many of ``n`` admits go through without waiting."""
    count = 0
    for _ in range(n):
        if not gate.can_admit():
            break
        await gate.admit(timeout_s=1.0)
        count += 1
    return count


async def test_a_gate_admits_up_to_k_plus_one_batches_ahead_and_no_more() -> None:
    gate = StalenessGate(max_staleness=1, batch_size=4)
    assert await admitted(gate, 20) == 8  # (1 + 0 + 1) * 4: the boundary is admitted, one more is not
    waiter = asyncio.create_task(gate.admit(timeout_s=5.0))
    await asyncio.sleep(0)  # let it check once: it must wait
    assert not waiter.done()
    gate.finish(accepted=True)  # accepted samples still count: the sum is unchanged
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.finish(accepted=False)  # a filtered sample frees its slot
    assert await asyncio.wait_for(waiter, 1.0) == 0
    gate.publish(1)  # one version more: one batch more may start
    assert await admitted(gate, 20) == 4


async def test_k_zero_is_one_batch_per_version() -> None:
    gate = StalenessGate(max_staleness=0, batch_size=3)
    assert await admitted(gate, 10) == 3
    for _ in range(3):
        gate.finish()
    assert not gate.can_admit()  # the batch is accepted but not trained on yet
    gate.publish(1)
    assert await admitted(gate, 10) == 3


async def test_recovery_counts_the_checkpoint_as_trained_and_misuse_is_refused() -> None:
    gate = StalenessGate(max_staleness=2, batch_size=4)
    gate.recover(5)
    assert gate.accepted == 20 and await admitted(gate, 100) == 12  # not a burst of 32
    with pytest.raises(TimeoutError):
        await gate.admit(timeout_s=0.01)
    with pytest.raises(InvalidRequestError, match="went back"):
        gate.publish(4)
    fresh = StalenessGate(0, 1)
    with pytest.raises(InvalidRequestError, match="without a matching admit"):
        fresh.finish()
    with pytest.raises(InvalidRequestError, match="without an accepted sample"):
        fresh.discard()
    gate.discard()  # one accepted sample too stale to train on: its place is free again
    assert gate.accepted == 19 and await admitted(gate, 100) == 1
    with pytest.raises(InvalidRequestError, match="max_staleness >= 0"):
        StalenessGate(-1, 4)
