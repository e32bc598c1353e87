"""The in-process compute engine of a worker: a table of open jobs and one entry point, ``execute``.

``execute`` is synchronous: the worker server runs it on its main thread, one call at a time.
``start`` runs some calls beside it and returns their futures, so other jobs' calls go on
meanwhile: with the vLLM sampler a LoRA job's ``generate`` (on vLLM's engine); and on a thread of
their own, one at a time (``background_calls``), an ``open``, whose slow part (loading a base
model, starting a vLLM engine, copying a model for a full fine-tune) touches nothing another call
uses and whose last part (the job's adapter on the shared base, its entry in the job table) runs
under the lock ``execute`` holds, and a ``save`` (a checkpoint or an export), which only reads
its job's state (the scheduler runs none of that job's other trainer calls meanwhile).
Typed plexrl errors mean the caller must change something; anything else propagates as-is and
the server reports it as a failed call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plexrl.errors import GangBrokenError, InvalidRequestError, PlexError, UnknownJobError
from plexrl.plan import WorkerPlan
from plexrl.protocol.calls import (
    Call,
    Close,
    ForwardBackward,
    Generate,
    JobSpec,
    Load,
    Logprobs,
    Open,
    Opened,
    OptimStep,
    Restore,
    Result,
    Save,
    Saved,
    SetWeights,
    SyncWeights,
)
from plexrl.protocol.messages import GangCall
from plexrl.worker import memory
from plexrl.worker.gang import Gang, Stores
from plexrl.worker.memory import Moved, planned_state_bytes
from plexrl.worker.models import BaseModel, ModelCache
from plexrl.worker.progress import Progress
from plexrl.worker.sampler.vllm import VllmConfig, VllmSampler
from plexrl.worker.trainer import checkpoint
from plexrl.worker.trainer.forward import TrainerSettings
from plexrl.worker.trainer.full import FullWeights
from plexrl.worker.trainer.job import Weights, WorkerJob, check_spec
from plexrl.worker.trainer.lora import LoraWeights

log = logging.getLogger("plexrl.worker")
SHARED = "shared"  # the checkpoint folder of jobs without a tenant (an unauthenticated coordinator)


@dataclass
class _Prepared:
    """An open's slow part, done off the main thread: the base model, the job's sampler engine, and
    (a full fine-tune job) its private copy of the weights."""

    base: BaseModel
    vllm: VllmSampler | None
    new_engine: bool  # ``vllm`` was started for this open (closed if the open fails)
    weights: FullWeights | None


class Engine:
    background_calls: tuple[str, ...] = ("open", "save")  # what ``start`` runs beside the main thread's calls

    def __init__(
        self,
        device: str = "cpu",
        sampler: str = "hf",
        vllm_config: VllmConfig | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
        trainer: TrainerSettings | None = None,
        rendezvous_host: str = "127.0.0.1",
    ) -> None:
        if sampler not in ("hf", "vllm"):
            raise ValueError(f"sampler={sampler!r}: choose 'vllm' or 'hf'")
        self.device = torch.device(device)
        self.sampler = sampler
        self.trainer = trainer or TrainerSettings()
        # One dtype for the worker: the trainer's frozen weights and forwards, the engine's weights
        # and the adapters published to it.
        self.vllm_config = dataclasses.replace(vllm_config or VllmConfig(), dtype=self.trainer.dtype)
        if self.device.type == "cuda":  # float32 matmuls (the masters' optimizer math) may use TF32
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._models = ModelCache(self.device, self.trainer.torch_dtype)
        self._vllm: dict[str, VllmSampler] = {}  # one vLLM engine per base model path
        self._jobs: dict[str, WorkerJob] = {}
        self._mover = memory.Mover(self.device)
        self.progress = Progress()  # ticked as calls advance (the heartbeat reports it)
        # Save / load paths: relative to root/<tenant> (a worker's); None: taken as given (in-process use).
        self.checkpoint_root = None if checkpoint_root is None else Path(checkpoint_root)
        self._tenants: dict[str, str] = {}
        # The job table and the shared base models: ``execute`` holds it for a call, an open for its last step.
        self._lock = threading.RLock()
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-beside")
        # Jobs on several workers: each one's process group with the others (``worker/gang.py``),
        # over the leader's rendezvous store (``stores.own`` is this worker's).
        self._gangs: dict[str, Gang] = {}
        self._stores: Stores | None = None
        self._rendezvous_host = rendezvous_host

    @property
    def stores(self) -> Stores:
        if self._stores is None:
            self._stores = Stores(self._rendezvous_host)
        return self._stores

    def rendezvous(self) -> str:
        return self.stores.address

    def plan(self) -> WorkerPlan:
        """This worker's device and the settings the memory plan needs (sent when it registers)."""
        vllm, trainer = self.vllm_config, self.trainer
        return WorkerPlan(
            capacity_bytes=memory.device_capacity(self.device),
            device_type=self.device.type,
            dtype=trainer.dtype,
            sampler=self.sampler,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            engine_sleep=vllm.engine_sleep,
            host_bytes=memory.device_capacity(torch.device("cpu")),
            cpu_kv_cache_bytes=vllm.kv_cache_gib << 30,
            max_model_len=vllm.max_model_len or 1 << 30,
            max_loras=vllm.max_loras,
            max_lora_rank=vllm.max_lora_rank,
            max_tokens_per_microbatch=trainer.max_tokens_per_microbatch or 1 << 30,
            chunk_elements=trainer.chunk_elements or 1 << 40,
            checkpointing_min_params=trainer.checkpointing_min_params,
        )

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def start(self, job_id: str, call: Call, priority: int = 0) -> Future[Result] | None:
        if isinstance(call, Open):
            return self._beside.submit(self._open, job_id, call)
        if isinstance(call, Save):
            return self._beside.submit(self._save, job_id, call)
        job = self._jobs.get(job_id)
        if isinstance(call, Generate) and job is not None and job.vllm is not None:
            if job.vllm.sleeping:  # the scheduler wakes engines before a generate; this is the safety net
                log.warning("job %s's generate found its engine asleep: waking it", job_id)
                job.vllm.wake()
            # vLLM samples with its own copy of the weights: the trainer's state may stay in the host
            # store (and may be moving on the mover's thread meanwhile): nothing here touches it.
            return job.generate_async(call.prompts, call.params, priority)  # type: ignore[return-value]
        return None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Pause the LoRA jobs' vLLM sampling while inside: a trainer call gets the device (on CPU:
        the core) to itself; requests in flight are kept and go on after. A full fine-tune job's
        own engine is not paused (it holds that one job's turns only)."""
        with self._lock:
            samplers = list(self._vllm.values())
        with contextlib.ExitStack() as paused:  # woken whatever happens, those paused so far included
            for sampler in samplers:
                if sampler.sleeping is None:
                    sampler.sleep(0)
                    paused.callback(sampler.wake)
            yield

    def move_engines(self, to: str, level: int) -> None:
        """Put every vLLM engine of this worker to sleep at ``level`` (``to`` ``asleep``: the
        scheduler's plan gives their memory to training) or wake them (``awake``). The scheduler
        runs no call that uses them meanwhile. A full fine-tune job's own engine sleeps at level 2
        only if the job keeps a copy of the weights it serves (its trainer steps before the wake
        that reloads them); else at level 1. A sleep that fails part-way wakes those it slept."""
        with self._lock:
            levels = {id(s): (s, level) for s in self._vllm.values()}  # LoRA engines: the base reloads them
            for job in self._jobs.values():
                if job.vllm is not None and job.key is None:
                    levels[id(job.vllm)] = (job.vllm, level if job.keeps_served_weights else min(level, 1))
        if to == "awake":
            for sampler, _ in levels.values():
                sampler.wake()
            return
        if to != "asleep":
            raise InvalidRequestError(f"engines cannot move {to!r}: choose 'asleep' or 'awake'")
        with contextlib.ExitStack() as slept:
            for sampler, at in levels.values():
                if sampler.sleeping is None:
                    sampler.sleep(at)
                    slept.callback(sampler.wake)
            slept.pop_all()  # all asleep: they stay so

    def close(self) -> None:
        self._beside.shutdown(wait=True, cancel_futures=True)
        for job in self._jobs.values():
            job.close()
        for sampler in self._vllm.values():
            sampler.close()
        self._vllm.clear()
        self._jobs.clear()
        for gang in self._gangs.values():
            gang.close()
        self._gangs.clear()
        self._stores = None  # its rendezvous store stops with it

    def move(self, job_id: str, to: str) -> Moved:
        """Move the job's state to ``to`` (``device`` or ``host``); measured. Safe on another thread
        than ``execute`` as long as the job itself has no call running (the scheduler's rule)."""
        job = self._job(job_id)
        self.progress.tick()
        if to == memory.DEVICE:
            return self._mover.to_device(job)
        if to == memory.HOST:
            return self._mover.to_host(job)
        raise InvalidRequestError(f"cannot move state to {to!r}: choose 'device' or 'host'")

    def execute(self, job_id: str, call: Call, gang: GangCall | None = None) -> Result:
        """Run ``call`` of job ``job_id``; ``gang``: this worker's part in a call of a job on
        several workers (every member runs it; they meet in collectives)."""
        with self._lock:
            if isinstance(call, Restore):  # the job rebuilt (maybe on this worker): what it had here goes
                self._drop(job_id)
            if gang is None:
                if job_id in self._gangs:  # the job narrowed to this worker alone: its group goes
                    self._gangs.pop(job_id).close()
                return self._execute(job_id, call, None)
            member = self._gang(job_id, gang)
            try:
                return self._execute(job_id, call, member)
            except PlexError:  # a deterministic refusal: every member refused alike, the gang is fine
                raise
            except Exception as e:  # between collectives: the members may have diverged
                raise member.breaks(type(call).__name__, e) from e
            finally:
                if isinstance(call, Close):
                    self._gangs.pop(job_id).close()

    def _drop(self, job_id: str) -> None:
        """Forget the job here, and its gang, if it has them."""
        job = self._jobs.pop(job_id, None)
        self._tenants.pop(job_id, None)
        if job is not None:
            job.close()
        gang = self._gangs.pop(job_id, None)
        if gang is not None:
            gang.close()

    def _gang(self, job_id: str, spec: GangCall) -> Gang:
        """The job's process group at ``spec``'s epoch: the one it has, or a new one."""
        gang = self._gangs.get(job_id)
        if gang is not None and (gang.spec.token, gang.epoch) == (spec.token, spec.epoch):
            return gang
        job = self._jobs.get(job_id)
        if gang is not None and job is not None and job.weights.sharded:
            raise GangBrokenError(
                f"job {job_id!r}'s gang changed (epoch {gang.epoch} to {spec.epoch}) while its weights are "
                "sharded over the old one: its state is rebuilt from its snapshot"
            )
        if gang is not None:
            gang.close()
        gang = self._gangs[job_id] = Gang(spec, self.stores.get(spec.store, spec.timeout_s), self.device)
        return gang

    def _execute(self, job_id: str, call: Call, gang: Gang | None) -> Result:
        if isinstance(call, Open):
            return self._open(job_id, call, gang)
        if isinstance(call, Restore):
            self._open(job_id, call.open, gang)
            try:
                self._jobs[job_id].restore(call.snapshot, call.replay)
            except BaseException:
                self._jobs.pop(job_id).close()  # nothing half-restored stays behind
                self._tenants.pop(job_id, None)
                raise
            return self._jobs[job_id].opened()
        job = self._job(job_id)
        job.gang = gang
        # Closing frees the state wherever it is; vLLM samples with its own copy of the weights, so
        # a generate there runs whether or not the trainer's state is in (the scheduler's rule too).
        if not isinstance(call, Close) and not (isinstance(call, Generate) and job.vllm is not None):
            self._resident(job, job_id, call)
        match call:
            case Generate(prompts=prompts, params=params):
                return job.generate(prompts, params)
            case Logprobs(tokens=tokens):
                return job.logprobs(tokens)
            case ForwardBackward(batch=batch, loss=loss, loss_config=config, forward_only=only, return_logprobs=lps):
                return job.forward_backward(batch, loss, config, forward_only=only, return_logprobs=lps)
            case OptimStep(snapshot=snapshot, adam=adam, reduction=reduction):
                return job.optim_step(snapshot, adam, reduction)
            case SyncWeights(export=export, inline=inline):
                return job.sync_weights(export or inline)  # the worker publishes exported tensors (dataplane.py)
            case SetWeights(weight_version=version, tensors=tensors) if tensors is not None:
                return job.set_weights(version, tensors)
            case Save():
                return self._save(job_id, call)
            case Load(path=path, export=export, snapshot=snapshot):
                return job.load(self._checkpoint_path(job_id, path), export, snapshot)
            case Close():
                del self._jobs[job_id]
                self._tenants.pop(job_id, None)
                return job.close()
        raise InvalidRequestError(f"the engine cannot execute {type(call).__name__} calls")

    def served_weights(self, job_id: str) -> tuple[int, dict[str, np.ndarray]]:
        """The weights the job's sampler serves now, and their version (to publish for other workers)."""
        return self._job(job_id).served_weights()

    def _save(self, job_id: str, call: Save) -> Saved:
        """Checkpoint or export a job: only its state is read, so outside the lock."""
        with self._lock:
            job = self._job(job_id)
            self._resident(job, job_id, call)
            path = self._checkpoint_path(job_id, call.path)
        return job.save(path, call.format)

    def _checkpoint_path(self, job_id: str, path: str) -> str:
        if self.checkpoint_root is None:
            return path
        return checkpoint.confined(self.checkpoint_root, self._tenants.get(job_id, SHARED), path)

    def _resident(self, job: WorkerJob, job_id: str, call: Call) -> None:
        """The scheduler moves state in before a call; this is the safety net if it did not."""
        if job.host_state is not None:
            log.warning(
                "job %s's state was in the host store when its %s arrived: moving it in", job_id, type(call).__name__
            )
            self._mover.to_device(job)

    def _job(self, job_id: str) -> WorkerJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(f"job {job_id!r} is not open on this engine; send Open first")
        return job

    def _open(self, job_id: str, call: Open, gang: Gang | None = None) -> Opened:
        """Open a job: the slow part first, on whatever thread this runs on, then the rest under the lock."""
        spec = call.spec
        if job_id in self._jobs:
            raise InvalidRequestError(f"job {job_id!r} is already open on this engine; close it or use a new id")
        check_spec(spec)
        prepared = self._prepare(spec, gang)
        try:
            with self._lock:
                return self._enter(job_id, call, prepared, gang)
        except BaseException:
            if prepared.new_engine and prepared.vllm is not None and prepared.vllm not in self._vllm.values():
                prepared.vllm.close()
            raise

    def _prepare(self, spec: JobSpec, gang: Gang | None) -> _Prepared:
        """What an open may do beside other calls: nothing here is used by another job yet."""
        base = self._models.get(spec.model)
        vllm, new_engine = None, False
        if self.sampler == "vllm" and spec.lora is not None:
            vllm, new_engine = self._vllm.get(os.path.abspath(spec.model)), False
            if vllm is None:
                vllm, new_engine = self._new_sampler(spec.model, lora=True), True
            vllm.check_rank(spec.lora.rank)
        elif self.sampler == "vllm":  # a full fine-tune job: an engine of its own, refit on sync
            vllm, new_engine = self._new_sampler(spec.model, lora=False), True
        # The hf sampler needs a copy of the weights to sample with; vLLM has its own.
        weights = FullWeights(base, sampler_copy=vllm is None, gang=gang) if spec.lora is None else None
        return _Prepared(base, vllm, new_engine, weights)

    def _enter(self, job_id: str, call: Open, prepared: _Prepared, gang: Gang | None) -> Opened:
        """An open's last step, under the lock: the job's adapter on the shared base, its entry."""
        spec, base, vllm = call.spec, prepared.base, prepared.vllm
        if job_id in self._jobs:
            raise InvalidRequestError(f"job {job_id!r} is already open on this engine; close it or use a new id")
        if vllm is not None and spec.lora is not None:
            shared = self._vllm.setdefault(os.path.abspath(spec.model), vllm)
            if shared is not vllm:  # another open started one meanwhile: serve from that one
                vllm.close()
                vllm = prepared.vllm = shared
        weights: Weights = (
            prepared.weights
            if prepared.weights is not None
            else LoraWeights(base, spec.lora, spec.seed, sampler_copy=vllm is None)  # type: ignore[arg-type]
        )
        key = job_id if vllm is not None and spec.lora is not None else None
        job = WorkerJob(spec, base, weights, vllm=vllm, key=key, progress=self.progress, settings=self.trainer)
        job.gang = gang
        if vllm is not None and vllm.restore is None:  # what a wake after a level-2 sleep loads
            vllm.restore = (lambda: base.weights) if key is not None else job.served_tensors
        if 0 < planned_state_bytes(job) <= call.snapshot_max_bytes:
            job.take_snapshots()
        self._jobs[job_id] = job
        self._tenants[job_id] = call.tenant or SHARED
        return job.opened()

    def _new_sampler(self, model: str, *, lora: bool) -> VllmSampler:
        return VllmSampler(model, self.device.type, self.vllm_config, lora=lora, progress=self.progress)

    def vllm_sampler(self, model: str) -> VllmSampler:
        """The vLLM engine serving ``model``'s LoRA jobs on this worker (its first LoRA job's open starts it)."""
        with self._lock:
            sampler = self._vllm.get(os.path.abspath(model))
        if sampler is None:
            raise UnknownJobError(f"no LoRA job of {model!r} has opened on this engine: it has no vLLM engine for it")
        return sampler
