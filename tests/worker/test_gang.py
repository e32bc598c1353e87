"""A gang's process group (``worker/gang.py``) between real processes over gloo: collectives,
several gangs over the same members, and deadlines when a member never comes or dies."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import gang_members as members
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    with members.pool() as pool:
        yield pool


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    """A rendezvous store in the test process (a worker's, in a real cluster)."""
    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    yield f"127.0.0.1:{own.port}"


def test_collectives_give_every_member_the_same_answer(pool: ProcessPoolExecutor, store: str) -> None:
    futures = [pool.submit(members.collectives, members.call(r, store, "collectives")) for r in range(2)]
    results = [f.result(timeout=60) for f in futures]
    for got in results:
        assert got["summed"] == [[3.0, 3.0, 3.0], [0.0, 3.0, 6.0, 9.0]]
        assert got["sent"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert got["gathered"] == [b"member 0 ", b"member 1 member 1 "]


def test_two_gangs_share_members_and_close_apart(pool: ProcessPoolExecutor, store: str) -> None:
    futures = [
        pool.submit(members.two_gangs, members.call(r, store, "job-a"), members.call(r, store, "job-b"))
        for r in range(2)
    ]
    assert [f.result(timeout=60) for f in futures] == [[2.0, 2.0, 20.0, 20.0]] * 2


def test_a_new_epoch_is_a_fresh_group(pool: ProcessPoolExecutor, store: str) -> None:
    for epoch in (1, 2):
        futures = [pool.submit(members.collectives, members.call(r, store, "again", epoch=epoch)) for r in range(2)]
        assert all(f.result(timeout=60)["sent"] == [0.0, 1.0, 2.0, 3.0, 4.0] for f in futures)


def test_a_member_that_never_comes_fails_the_rendezvous_by_its_deadline(pool: ProcessPoolExecutor, store: str) -> None:
    # Without a deadline the rendezvous would wait forever (and the result's timeout fail the test).
    said = pool.submit(members.alone, members.call(0, store, "nobody-else", timeout_s=2.0)).result(timeout=60)
    assert "could not connect" in said


def test_a_member_killed_mid_collective_breaks_the_gang_for_good(store: str) -> None:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as survivor, ProcessPoolExecutor(1, mp_context=spawn) as victim:
        said = survivor.submit(members.killed_peer, members.call(0, store, "killed", timeout_s=3.0))
        victim.submit(members.killed_peer, members.call(1, store, "killed", timeout_s=3.0))
        first, again = said.result(timeout=60).split(" | ")
    assert "broke during all_reduce" in first and "rebuilt" in first
    assert "is broken" in again  # never used again
