"""Process groups between workers for a job that trains on several of them (a gang), with deadlines.

A worker may sit in several gangs at once (one per multi-worker job, each over its own workers),
and gangs form and dissolve as jobs open, move and lose workers, so there is no global "world":
each gang is a gloo (NCCL on CUDA) process group of its own, built over the leader's
``TCPStore`` under a per-epoch prefix, and registered with torch.distributed only so that FSDP2
and DTensor, which look groups up there, can use it. Everything torch-private is in this module.

Every collective has a deadline (the group's timeout, ``GangCall.timeout_s``); one that fails or
times out marks the gang broken and raises ``GangBrokenError``: its members may have diverged
mid-call, so a broken gang is never used again (the coordinator rebuilds the job's state).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from plexrl.errors import GangBrokenError
from plexrl.protocol.messages import GangCall

log = logging.getLogger("plexrl.worker")
T = TypeVar("T")
_made = itertools.count()  # process groups made here: each one's name is new


class Stores:
    """This worker's ``TCPStore`` (the rendezvous of the gangs it leads) and clients of its peers'."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self.own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.address = f"{host}:{self.own.port}"
        self._peers: dict[str, dist.Store] = {}

    def get(self, address: str, timeout_s: float) -> dist.Store:
        """The store at ``address`` (``host:port``); connecting waits at most ``timeout_s``."""
        if address == self.address:
            return self.own
        with self._lock:
            store = self._peers.get(address)
            if store is None:
                host, port = address.rsplit(":", 1)
                try:
                    store = dist.TCPStore(
                        host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
                    )
                except (RuntimeError, dist.DistError) as e:
                    raise GangBrokenError(f"cannot reach the gang's rendezvous at {address} ({e})") from e
                self._peers[address] = store
            return store


class Gang:
    """One job's process group at one epoch: this member's ``rank`` of ``world``."""

    def __init__(self, spec: GangCall, store: dist.Store, device: torch.device) -> None:
        self.spec = spec
        self.rank, self.world, self.epoch = spec.rank, spec.world, spec.epoch
        self.device = device
        self.broken: str | None = None
        self.name = f"plexrl/{spec.token}/{spec.epoch}"
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        prefixed = dist.PrefixStore(self.name, store)
        _ensure_default_group()
        try:
            self.group = _process_group(prefixed, f"{self.name}#{next(_made)}", spec, timeout, device)
        except (RuntimeError, dist.DistError) as e:  # a peer never came: the rendezvous timed out
            raise GangBrokenError(f"gang {self.name}: rank {spec.rank} of {spec.world} could not connect ({e})") from e
        self._mesh: Any = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` over the gang (FSDP2's ``fully_shard(mesh=...)``)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            # Named after the group: DTensor caches plans by mesh, and meshes of equal names are equal.
            name = self.group.group_name
            mesh = DeviceMesh(
                self.device.type, torch.arange(self.world), mesh_dim_names=(name,), _init_backend=False, _rank=self.rank
            )
            mesh._dim_group_names = [name]
            mesh._pg_registry[name] = self.group
            self._mesh = mesh
        return self._mesh

    def guard(self, what: str, work: Callable[[], T]) -> T:
        """Run ``work`` (which runs collectives on this gang); any failure breaks the gang."""
        if self.broken is not None:
            raise GangBrokenError(f"gang {self.name} is broken ({self.broken}): its state is rebuilt before reuse")
        try:
            return work()
        except GangBrokenError:
            raise
        except Exception as e:
            raise self.breaks(what, e) from e

    def breaks(self, what: str, e: BaseException) -> GangBrokenError:
        """Mark the gang broken by ``e`` (raised during ``what``); the error to raise."""
        self.broken = f"{what}: {type(e).__name__}: {e}"
        log.warning("gang %s broke in %s: %s", self.name, what, e)
        return GangBrokenError(
            f"gang {self.name} broke during {what} ({type(e).__name__}: {e}); the members may have "
            "diverged, so the job's state is rebuilt from its snapshot (or the job is lost)"
        )

    def all_reduce_(self, tensors: Sequence[Tensor]) -> None:
        """Sum ``tensors`` over the members, in place (one flat float32 bucket per dtype)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)

        def run() -> None:
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                self._wait(self.group.allreduce([flat]))
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

        self.guard("all_reduce", run)

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every member with member ``src``'s."""

        def run() -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            for t in tensors:
                self._wait(self.group.broadcast([t], opts))

        self.guard("broadcast", run)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every member's ``data``, in rank order."""

        def run() -> list[bytes]:
            on = self.device
            size = torch.tensor([len(data)], dtype=torch.int64, device=on)
            sizes = [torch.zeros(1, dtype=torch.int64, device=on) for _ in range(self.world)]
            self._wait(self.group.allgather([sizes], [size]))
            top = int(max(int(s) for s in sizes))
            mine = torch.zeros(top, dtype=torch.uint8)
            mine[: len(data)] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
            out = [torch.zeros(top, dtype=torch.uint8, device=on) for _ in range(self.world)]
            self._wait(self.group.allgather([out], [mine.to(self.device)]))
            return [o[: int(s)].cpu().numpy().tobytes() for o, s in zip(out, sizes, strict=True)]

        return self.guard("all_gather", run)

    def close(self) -> None:
        """Drop the group (and its sockets); its name is unregistered so a new epoch's can take over."""
        try:
            if self.broken is not None:
                self.group.abort()
            dist.destroy_process_group(self.group)
        except Exception as e:  # closing a broken group may fail again: nothing is left to save
            log.debug("gang %s close: %s", self.name, e)

    def _wait(self, work: Any) -> None:
        if not work.wait(datetime.timedelta(seconds=self.spec.timeout_s)):
            raise TimeoutError(f"collective did not finish in {self.spec.timeout_s} s")


def _ensure_default_group() -> None:
    """A one-process default group: torch.distributed's helpers (``get_rank(group)``, used by FSDP2)
    need one. Each gang maps this process's rank in it (0) to its rank in the gang."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _process_group(
    store: dist.Store, name: str, spec: GangCall, timeout: datetime.timedelta, device: torch.device
) -> dist.ProcessGroup:
    """A process group over ``store`` that torch.distributed knows by ``name`` (unique in this
    process), as ``new_group`` would make it, without the default group's members."""
    rank, world = spec.rank, spec.world
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend: Any = dist.ProcessGroupNCCL(store, rank, world, opts)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, world, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    backend._set_sequence_number_for_group()
    group = dist.ProcessGroup(store, rank, world)
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    group._set_group_name(name)  # type: ignore[arg-type]  # GroupName is a str
    kind_name = "nccl" if device.type == "cuda" else "gloo"
    rank_mapping = {dist.get_rank(): rank}
    c10d._register_pg_in_world(group, kind_name, store, name, kind_name, rank_mapping=rank_mapping)  # type: ignore[arg-type]
    return group
