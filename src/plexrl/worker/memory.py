"""Residency on a worker: a job's state moves between the device store and the host store, for real.

A job's movable state is its trainer weights (LoRA adapter or full copy) and their gradients,
its AdamW moments, and the sampler copy the hf sampler runs (under vLLM the sampler's adapters
live in vLLM, whose own LoRA cache manages them). The shared frozen base model stays put.

Moving out copies every tensor into a host buffer (pinned, on a side stream, on CUDA), then
frees the device tensor: a parameter keeps its identity (the optimizer and peft hold it) but
its ``data`` becomes an empty placeholder, so running on state that is not resident fails
loudly instead of computing garbage. Moving in allocates device tensors, copies, waits for the
copies, then puts them in place. On CPU both stores are RAM and the device budget is declared,
but the copies and frees are the same real work.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from plexrl.worker.trainer.job import WorkerJob

DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class Moved:
    """One transition, as measured by the worker."""

    to: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class _Ref:
    """Where one state tensor lives: read it, or put another tensor (or None, for a gradient) there."""

    get: Callable[[], Tensor | None]
    put: Callable[[Tensor | None], None]
    placeholder: bool  # out: an empty tensor stays in its place (parameters); else None (gradients)


def _param_ref(p: torch.nn.Parameter) -> _Ref:
    def put(t: Tensor | None) -> None:
        assert t is not None
        p.data = t

    return _Ref(lambda: p.data, put, placeholder=True)


def _grad_ref(p: torch.nn.Parameter) -> _Ref:
    def put(t: Tensor | None) -> None:
        p.grad = t

    return _Ref(lambda: p.grad, put, placeholder=False)


def _entry_ref(state: dict[str, object], key: str) -> _Ref:
    def get() -> Tensor | None:
        value = state.get(key)
        return value if isinstance(value, Tensor) else None

    def put(t: Tensor | None) -> None:
        state[key] = t

    return _Ref(get, put, placeholder=True)


def state_refs(job: WorkerJob) -> dict[str, _Ref]:
    """Every movable tensor of ``job`` but its shards (``shard_storages``), in the order a move
    *in* restores them (parameters first: a gradient must match its parameter's shape)."""
    weights = job.weights
    refs: dict[str, _Ref] = {}
    trained = {name: p for name, p in weights.trainer_params.items() if not isinstance(p, DTensor)}
    for name, p in trained.items():
        refs[f"trainer/{name}"] = _param_ref(p)
    for name, p in weights.sampler_params.items():
        refs[f"sampler/{name}"] = _param_ref(p)
    for name, p in trained.items():
        refs[f"grad/{name}"] = _grad_ref(p)
        state = job.optimizer.state.get(p, {})
        for key, value in state.items():
            if isinstance(value, Tensor) and value.ndim > 0:  # AdamW's scalar step counter stays
                refs[f"optim/{name}/{key}"] = _entry_ref(state, key)
    return refs


def shard_storages(job: WorkerJob) -> dict[str, torch.UntypedStorage]:
    """The storages of a sharded job's shards (FSDP2's parameters, their gradients and moments:
    DTensors), each once. FSDP2 keeps views into them, so a move empties and refills them in
    place (``resize_``) rather than putting other tensors in their place."""
    out: dict[str, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for name, p in job.weights.trainer_params.items():
        if not isinstance(p, DTensor):
            continue
        state = job.optimizer.state.get(p, {})
        moments = {f"optim/{name}/{k}": v for k, v in state.items() if isinstance(v, DTensor)}
        for key, t in {f"trainer/{name}": p, f"grad/{name}": p.grad, **moments}.items():
            if isinstance(t, DTensor):
                storage = t.to_local().untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    out[key] = storage
    return out


def device_capacity(device: torch.device) -> int:
    """The device's memory in bytes: a GPU's total, or on CPU the machine's RAM (where the trainer,
    the engine and the host store all live)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_state_bytes(job: WorkerJob) -> int:
    """What the job's state takes on the device once it has stepped: trainer weights, their
    gradients and two AdamW moments, plus the hf sampler's copy (none when vLLM samples)."""
    trainer = sum(_local(p).numel() * p.element_size() for p in job.weights.trainer_params.values())
    sampler = sum(p.numel() * p.element_size() for p in job.weights.sampler_params.values())
    return 4 * trainer + sampler


def _local(t: Tensor) -> Tensor:
    """What this worker holds of ``t``: its shard if ``t`` is sharded over a gang (a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes_of(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor over ``storage`` (its bytes, for copying)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Mover:
    """Performs a worker's state transitions; one at a time (the scheduler sends one per worker)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    def to_host(self, job: WorkerJob) -> Moved:
        if job.host_state is not None:
            return Moved(HOST, 0, 0.0)
        start = time.perf_counter()
        refs, shards = state_refs(job), shard_storages(job)
        tensors = {k: t for k, r in refs.items() if (t := r.get()) is not None}
        tensors |= {f"shard:{k}": _bytes_of(s) for k, s in shards.items()}
        store = self._copy(tensors, to_host=True)
        for key in reversed(list(refs)):  # gradients before their parameters
            ref = refs[key]
            if key in store:
                t = store[key]
                ref.put(torch.empty(0, dtype=t.dtype, device=self.device) if ref.placeholder else None)
        for shard in shards.values():
            shard.resize_(0)
        job.host_state = store
        return Moved(HOST, sum(t.nbytes for t in store.values()), time.perf_counter() - start)

    def to_device(self, job: WorkerJob) -> Moved:
        store = job.host_state
        if store is None:
            return Moved(DEVICE, 0, 0.0)
        start = time.perf_counter()
        refs, shards = state_refs(job), shard_storages(job)
        for key, shard in shards.items():  # refilled in place: FSDP2's views see them again
            saved = store[f"shard:{key}"]
            shard.resize_(saved.nbytes)
            _bytes_of(shard).copy_(saved)
        placed = self._copy({k: t for k, t in store.items() if not k.startswith("shard:")}, to_host=False)
        for key, ref in refs.items():  # parameters, then gradients and moments
            if key in placed:
                ref.put(placed[key])
        job.host_state = None
        return Moved(DEVICE, sum(t.nbytes for t in store.values()), time.perf_counter() - start)

    def _copy(self, tensors: dict[str, Tensor], to_host: bool) -> dict[str, Tensor]:
        """Copies of ``tensors`` in the host store (pinned on CUDA) or on the device, made on the
        side stream and complete when this returns."""
        side = contextlib.nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensors' producers first
        copies: dict[str, Tensor] = {}
        with side:
            for key, t in tensors.items():
                if to_host:
                    copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._cuda)
                else:
                    copy = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                copies[key] = copy.copy_(t, non_blocking=self._cuda)
        if self._stream is not None:
            self._stream.synchronize()
        return copies
