"""The in-process compute engine of a worker: a table of open jobs and one entry point, ``execute``.

``execute`` is synchronous and not thread-safe: the worker server runs it on its main thread,
one call at a time. ``start`` is the one way around that: with the vLLM sampler, a LoRA job's
``generate`` starts on vLLM's engine and returns a future, so other jobs' calls go on meanwhile. Typed plexrl errors mean the caller must change something;
anything else propagates as-is and the server reports it as a failed call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from plexrl.errors import InvalidRequestError, UnknownJobError
from plexrl.plan import WorkerPlan
from plexrl.protocol.calls import (
    Call,
    Close,
    ForwardBackward,
    Generate,
    Load,
    Logprobs,
    Open,
    Opened,
    OptimStep,
    Restore,
    Result,
    Save,
    SetWeights,
    SyncWeights,
)
from plexrl.worker import memory
from plexrl.worker.memory import Moved, planned_state_bytes
from plexrl.worker.models import ModelCache
from plexrl.worker.progress import Progress
from plexrl.worker.sampler.vllm import VllmConfig, VllmSampler
from plexrl.worker.trainer import checkpoint
from plexrl.worker.trainer.forward import TrainerSettings
from plexrl.worker.trainer.full import FullWeights
from plexrl.worker.trainer.job import Weights, WorkerJob, check_spec
from plexrl.worker.trainer.lora import LoraWeights

log = logging.getLogger("plexrl.worker")
SHARED = "shared"  # the checkpoint folder of jobs without a tenant (an unauthenticated coordinator)


class Engine:
    def __init__(
        self,
        device: str = "cpu",
        sampler: str = "hf",
        vllm_config: VllmConfig | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
        trainer: TrainerSettings | None = None,
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

    def plan(self) -> WorkerPlan:
        """This worker's device and the settings the memory plan needs (sent when it registers)."""
        vllm, trainer = self.vllm_config, self.trainer
        return WorkerPlan(
            capacity_bytes=memory.device_capacity(self.device),
            device_type=self.device.type,
            dtype=trainer.dtype,
            sampler=self.sampler,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
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
        job = self._jobs.get(job_id)
        if isinstance(call, Generate) and job is not None and job.vllm is not None:
            # vLLM samples with its own copy of the weights: the trainer's state may stay in the host
            # store (and may be moving on the mover's thread meanwhile): nothing here touches it.
            return job.generate_async(call.prompts, call.params, priority)  # type: ignore[return-value]
        return None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Pause the LoRA jobs' vLLM sampling while inside: a trainer call gets the device (on CPU:
        the core) to itself; requests in flight are kept and go on after. A full fine-tune job's
        own engine is not paused (it holds that one job's turns only)."""
        with contextlib.ExitStack() as paused:  # woken whatever happens, those paused so far included
            for sampler in self._vllm.values():
                if sampler.sleeping is None:
                    sampler.sleep(0)
                    paused.callback(sampler.wake)
            yield

    def close(self) -> None:
        for job in self._jobs.values():
            job.close()
        for sampler in self._vllm.values():
            sampler.close()
        self._vllm.clear()
        self._jobs.clear()

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

    def execute(self, job_id: str, call: Call) -> Result:
        if isinstance(call, Open):
            return self._open(job_id, call)
        if isinstance(call, Restore):
            self._open(job_id, call.open)
            try:
                self._jobs[job_id].restore(call.snapshot, call.replay)
            except BaseException:
                self._jobs.pop(job_id).close()  # nothing half-restored stays behind
                self._tenants.pop(job_id, None)
                raise
            return self._jobs[job_id].opened()
        job = self._job(job_id)
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
            case Save(path=path, format=fmt):
                return job.save(self._checkpoint_path(job_id, path), fmt)
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

    def _open(self, job_id: str, call: Open) -> Opened:
        spec = call.spec
        if job_id in self._jobs:
            raise InvalidRequestError(f"job {job_id!r} is already open on this engine; close it or use a new id")
        check_spec(spec)
        base = self._models.get(spec.model)
        vllm, key = None, None
        if self.sampler == "vllm" and spec.lora is not None:
            vllm, key = self.vllm_sampler(spec.model), job_id
            vllm.check_rank(spec.lora.rank)
        elif self.sampler == "vllm":  # a full fine-tune job: an engine of its own, refit on sync
            vllm = VllmSampler(spec.model, self.device.type, self.vllm_config, lora=False, progress=self.progress)
        hf = vllm is None  # the hf sampler needs a copy of the weights to sample with; vLLM has its own
        weights: Weights = (
            FullWeights(base, sampler_copy=hf)
            if spec.lora is None
            else LoraWeights(base, spec.lora, spec.seed, sampler_copy=hf)
        )
        job = WorkerJob(spec, base, weights, vllm=vllm, key=key, progress=self.progress, settings=self.trainer)
        if 0 < planned_state_bytes(job) <= call.snapshot_max_bytes:
            job.take_snapshots()
        self._jobs[job_id] = job
        self._tenants[job_id] = call.tenant or SHARED
        return job.opened()

    def vllm_sampler(self, model: str) -> VllmSampler:
        """The vLLM engine serving ``model``'s LoRA jobs on this worker (started on first use)."""
        import os

        key = os.path.abspath(model)
        if key not in self._vllm:
            self._vllm[key] = VllmSampler(model, self.device.type, self.vllm_config, progress=self.progress)
        return self._vllm[key]
