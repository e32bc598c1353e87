"""What each member process of the gang tests runs (importable by spawned processes)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from plexrl.errors import GangBrokenError
from plexrl.protocol.messages import GangCall
from plexrl.worker.gang import Gang, Stores

_stores: Stores | None = None


def pool(members: int = 2) -> ProcessPoolExecutor:
    """Member processes (torch on one thread each), reused by a module's tests."""
    return ProcessPoolExecutor(members, mp_context=multiprocessing.get_context("spawn"), initializer=_init)


def _init() -> None:
    torch.set_num_threads(1)


def stores() -> Stores:
    global _stores
    if _stores is None:
        _stores = Stores()
    return _stores


def call(rank: int, store: str, token: str, *, epoch: int = 0, world: int = 2, timeout_s: float = 20.0) -> GangCall:
    return GangCall(epoch=epoch, rank=rank, world=world, store=store, token=token, timeout_s=timeout_s)


def open_gang(spec: GangCall) -> Gang:
    return Gang(spec, stores().get(spec.store, spec.timeout_s), torch.device("cpu"))


def collectives(spec: GangCall) -> dict[str, Any]:
    """Each collective once; what this member ends with."""
    gang = open_gang(spec)
    try:
        summed = [torch.full((3,), float(spec.rank + 1)), torch.arange(4, dtype=torch.float64) * (spec.rank + 1)]
        gang.all_reduce_(summed)
        sent = torch.arange(5, dtype=torch.float32) if spec.rank == 0 else torch.zeros(5)
        gang.broadcast_([sent])
        gathered = gang.all_gather_bytes(b"member %d " % spec.rank * (spec.rank + 1))
        return {"summed": [t.tolist() for t in summed], "sent": sent.tolist(), "gathered": gathered}
    finally:
        gang.close()


def two_gangs(first: GangCall, second: GangCall) -> list[float]:
    """Two gangs over the same members; the first closed, then the second still sums."""
    a, b = open_gang(first), open_gang(second)
    x = torch.ones(2)
    a.all_reduce_([x])
    a.close()
    y = torch.full((2,), 10.0)
    b.all_reduce_([y])
    b.close()
    return x.tolist() + y.tolist()


def alone(spec: GangCall) -> str:
    """Join a gang whose other member never comes; what it raises."""
    try:
        open_gang(spec)
    except GangBrokenError as e:
        return str(e)
    return "joined"


def killed_peer(spec: GangCall) -> str:
    """Rank 1 dies in the middle of the second all-reduce; rank 0 says what it saw and when."""
    gang = open_gang(spec)
    gang.all_reduce_([torch.ones(1)])
    if spec.rank == 1:
        os._exit(9)
    try:
        gang.all_reduce_([torch.ones(1)])
    except GangBrokenError as e:
        try:
            gang.all_reduce_([torch.ones(1)])
        except GangBrokenError as again:
            return f"{e} | {again}"
    return "summed"
