"""The adapter registry and fair admission in front of a sampling engine (with a fake engine)."""

from __future__ import annotations

import asyncio

import pytest

from plexrl.worker.sampler.adapters import AdapterRegistry, AdapterVersion, AdapterWeights, FairAdmission


class FakeAdapterEngine:
    """Records what a real engine would be told; fails if an adapter in use is unloaded."""

    def __init__(self) -> None:
        self.resident: set[str] = set()
        self.log: list[str] = []

    async def load(self, adapter: AdapterVersion) -> None:
        assert adapter.name not in self.resident
        assert adapter.weights is not None, f"{adapter.name} loaded after it was dropped"
        self.resident.add(adapter.name)
        self.log.append(f"load {adapter.name}")

    async def unload(self, adapter: AdapterVersion) -> None:
        assert adapter.refs == 0, f"{adapter.name} unloaded with {adapter.refs} requests using it"
        self.resident.remove(adapter.name)
        self.log.append(f"unload {adapter.name}")


def weights(name: str) -> AdapterWeights:
    return AdapterWeights(tensors=name.encode(), config={"r": 1})


async def test_versions_have_their_own_names_and_go_only_when_superseded_and_unreferenced() -> None:
    engine = FakeAdapterEngine()
    registry = AdapterRegistry(engine, max_loaded=4)
    await registry.publish("a", 0, weights("a0"))
    v0 = await registry.acquire("a")  # a request of version 0 in flight
    await registry.publish("a", 1, weights("a1"))
    assert engine.resident == {"a@v0"} and v0.weights == weights("a0")  # still in use: it stays
    v1 = await registry.acquire("a")
    assert (v0.name, v1.name) == ("a@v0", "a@v1") and v0.lora_id != v1.lora_id
    await registry.release(v0)
    assert engine.resident == {"a@v1"} and v0.weights is None  # its last request ended: memory freed
    await registry.drop("a")  # the job closed while v1 is in use
    assert engine.resident == {"a@v1"}
    await registry.release(v1)
    assert engine.resident == set() and v1.weights is None
    with pytest.raises(RuntimeError, match="released more often"):
        await registry.release(v1)


async def test_beyond_its_budget_the_least_recently_used_idle_adapter_is_unloaded_never_one_in_use() -> None:
    engine = FakeAdapterEngine()
    registry = AdapterRegistry(engine, max_loaded=2)
    for key in "abc":
        await registry.publish(key, 0, weights(key))
    a = await registry.acquire("a")
    b = await registry.acquire("b")
    await registry.release(b)
    c = await registry.acquire("c")  # room: b is idle, a is not
    assert engine.resident == {"a@v0", "c@v0"} and "unload b@v0" in engine.log
    d = await registry.acquire("b")  # a and c both in use: the engine holds 3 for now
    assert engine.resident == {"a@v0", "b@v0", "c@v0"}
    for adapter in (a, c, d):
        await registry.release(adapter)
    again = await registry.acquire("a")  # loads nothing: still resident
    assert engine.log.count("load a@v0") == 1
    await registry.release(again)


async def test_admission_keeps_arrival_order_and_at_most_max_active_adapters() -> None:
    gate = FairAdmission(max_active=2)
    await gate.admit("a")
    await gate.admit("b")
    await gate.admit("a")  # active already and nobody waits: straight in
    c = asyncio.create_task(gate.admit("c"))
    a_again = asyncio.create_task(gate.admit("a"))  # active, but c waits: behind c
    await asyncio.sleep(0)
    assert not c.done() and not a_again.done() and gate.waiting == 2
    gate.done("b")  # a slot frees: c goes in, then a (active) after it
    await asyncio.wait_for(asyncio.gather(c, a_again), 1.0)
    assert gate.in_flight == {"a": 3, "c": 1}


async def test_no_tenant_starves_while_31_others_keep_the_engine_busy() -> None:
    """32 tenants, each sending requests back to back; 4 adapters fit the engine at once. Every
    tenant is served, and none waits behind more than one round of the others."""
    gate = FairAdmission(max_active=4)
    served: dict[str, int] = {}
    order: list[str] = []

    async def tenant(key: str, requests: int) -> None:
        for _ in range(requests):
            await gate.admit(key)
            order.append(key)
            await asyncio.sleep(0)  # the request runs for one loop turn
            served[key] = served.get(key, 0) + 1
            gate.done(key)

    keys = [f"t{i}" for i in range(32)]
    await asyncio.wait_for(asyncio.gather(*(tenant(k, 5) for k in keys)), 10.0)
    assert served == {k: 5 for k in keys}
    first = {k: order.index(k) for k in keys}
    assert max(first.values()) < 32 + 4  # every tenant's first request got in within one round


async def test_a_cancelled_wait_leaves_no_trace() -> None:
    gate = FairAdmission(max_active=1)
    await gate.admit("a")
    waiter = asyncio.create_task(gate.admit("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.waiting == 0
    gate.done("a")
    await asyncio.wait_for(gate.admit("c"), 1.0)
    assert gate.in_flight == {"c": 1}
