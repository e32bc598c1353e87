"""What the gateway keeps per API key: Tinker sessions, their training models (plexrl jobs) and
sampling sessions, and the order its requests run in.

A training client's requests carry ``seq_id`` 1, 2, ... (one counter for forward_backward,
optim_step, save and load; the chunks of one forward_backward are sent at once, the first one
last): each is submitted to its plexrl job only once every lower one has been (plexrl then runs a
job's calls in submission order), and a request sent again (the SDK retries with the same
``seq_id``) gets the first one's request id instead of running twice. A sampling session samples
from its training model's job at the weight version ``save_weights_for_sampler`` published, or
from the base model (a job of its own, never trained).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from plexrl.client.job import Job
from plexrl.errors import InvalidRequestError
from plexrl.gateway import wire
from plexrl.gateway.futures import Futures, Json, Outcome, Proto
from plexrl.gateway.tenants import Tenants
from plexrl.protocol import calls
from plexrl.types import AdamW, LoRA, SamplingParams

log = logging.getLogger("plexrl.gateway")

T = TypeVar("T")
GAP_S = 300.0  # a request waits this long for the requests numbered below it, then fails
SESSION_TIMEOUT_S = 120.0  # a session without a heartbeat this long is finished (the SDK beats every 10 s)
DEFAULT_MAX_TOKENS = 256  # a sample's max_tokens when the request names none


class NotFoundError(InvalidRequestError):
    """An id the gateway does not know (or that belongs to another API key): HTTP 404."""

    code = "not_found"


@dataclass
class Model:
    """A Tinker training client: one plexrl job."""

    model_id: str
    owner: str
    session_id: str
    base_model: str
    rank: int
    job: Job
    next_seq: int = 1  # the seq_id whose turn it is
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    version: int = 0  # the weight version its job's sampler serves


@dataclass
class Sampler:
    """A Tinker sampling session: a job's sampler at one weight version (None: the base model's)."""

    sampler_id: str
    owner: str
    base_model: str
    job: Job
    model: Model | None = None
    version: int | None = None
    model_path: str | None = None


@dataclass
class Session:
    session_id: str
    owner: str
    heard_at: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


class Gateway:
    """The Tinker service on one plexrl client."""

    def __init__(self, tenants: Tenants, futures: Futures | None = None) -> None:
        self.tenants = tenants
        self.futures = futures or Futures()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._by_seq: dict[tuple[str, str, int], str] = {}  # (owner, client id, seq_id) -> request id
        self._paths: dict[str, tuple[Model, int]] = {}  # tinker://... sampler weights -> (model, version)
        self._base_jobs: dict[tuple[str, str], Job] = {}  # (owner, base model) -> its never-trained job
        self._opening: dict[tuple[str, str], asyncio.Future[Job]] = {}
        self._jobs_opened = 0

    # -- sessions -------------------------------------------------------------------------------

    def create_session(self, owner: str, request_id: str) -> str:
        session_id = request_id
        self.sessions[session_id] = Session(session_id, owner, time.monotonic())
        log.info("session %s created", session_id)
        return session_id

    def session(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFoundError(f"no session {session_id!r} of this API key (finished, or timed out)")
        return session

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.session(owner, session_id).heard_at = time.monotonic()

    async def finish(self, owner: str, session_id: str) -> None:
        """Close the session's jobs (its training models' and base-model samplers are freed)."""
        session = self.session(owner, session_id)
        del self.sessions[session_id]
        # Its clients' ids (models, samplers) all start with the session's: their retries are over.
        for key in [k for k in self._by_seq if k[0] == owner and k[1].startswith(session_id)]:
            del self._by_seq[key]
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)
        for model_id in session.models:
            model = self.models.pop(model_id, None)
            if model is not None:
                await model.job.close()
        log.info("session %s finished (%d models)", session_id, len(session.models))

    async def expire(self) -> None:
        """Finish sessions whose client stopped heartbeating."""
        cutoff = time.monotonic() - SESSION_TIMEOUT_S
        for session in [s for s in self.sessions.values() if s.heard_at < cutoff]:
            log.warning("session %s sent no heartbeat for %g s: finishing it", session.session_id, SESSION_TIMEOUT_S)
            await self.finish(session.owner, session.session_id)

    # -- requests -------------------------------------------------------------------------------

    def submit(self, owner: str, key: tuple[str, int] | None, work: Callable[[], Awaitable[Outcome]]) -> str:
        """Start ``work`` as a future; a request seen before under ``key`` (its client and seq_id)
        gets the request id it got then."""
        if key is not None and (owner, *key) in self._by_seq:
            return self._by_seq[(owner, *key)]
        request_id = self.futures.start(owner, work())
        if key is not None:
            self._by_seq[(owner, *key)] = request_id
        return request_id

    async def in_order(self, model: Model, seq_id: int | None, submit: Callable[[], Awaitable[T]]) -> T:
        """Submit a training client's request once every lower ``seq_id`` is submitted, then await it.
        A request that fails before it reaches plexrl (a bad batch) still takes its turn, so the
        ones after it run."""
        if seq_id is None:
            return await submit()
        async with model.turn:
            if seq_id < model.next_seq:
                raise InvalidRequestError(
                    f"seq_id {seq_id} of {model.model_id} is already past (next is {model.next_seq})"
                )
            try:
                async with asyncio.timeout(GAP_S):
                    await model.turn.wait_for(lambda: model.next_seq == seq_id)
            except TimeoutError:
                raise InvalidRequestError(
                    f"seq_id {seq_id} of {model.model_id} waited {GAP_S:g} s for seq_id {model.next_seq}, which never came"
                ) from None
            pending: asyncio.Future[T]
            try:
                pending = asyncio.ensure_future(submit())  # plexrl's client sends the call now: its place in the job
            except Exception as e:
                pending = asyncio.get_running_loop().create_future()
                pending.set_exception(e)
            model.next_seq += 1
            model.turn.notify_all()
        return await pending

    # -- training models ------------------------------------------------------------------------

    async def create_model(self, owner: str, request: dict[str, Any]) -> Outcome:
        session = self.session(owner, request["session_id"])
        seq = int(request["model_seq_id"])
        model_id = f"{session.session_id}:train:{seq}"
        lora = request.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        spec = calls.JobSpec(model=request["base_model"], lora=LoRA(rank=rank), optimizer=AdamW(),
                             seed=int(lora.get("seed") or 0))  # fmt: skip
        job = await self._open(owner, f"tinker.{session.session_id[:8]}.{seq}", spec)
        self.models[model_id] = Model(model_id, owner, session.session_id, spec.model, rank, job)
        session.models.append(model_id)
        return Json({"model_id": model_id})

    def model(self, owner: str, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFoundError(f"no training model {model_id!r} of this API key")
        return model

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.model(owner, model_id)
        return {
            "type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.rank,
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model},
        }  # fmt: skip

    async def forward_backward(self, model: Model, request: Any) -> Outcome:
        def submit() -> asyncio.Future[calls.ForwardBackwardResult]:
            train = wire.training(request)
            call = calls.ForwardBackward(batch=train.batch, loss=train.loss, loss_config=train.config,
                                         forward_only=train.forward_only, return_logprobs=True)  # fmt: skip
            train.batch.validate(train.loss)
            return model.job._submit(call, calls.ForwardBackwardResult)

        result = await self.in_order(model, request.seq_id or None, submit)
        return Proto(wire.forward_backward_output(result))

    async def optim_step(self, model: Model, request: dict[str, Any]) -> Outcome:
        def submit() -> asyncio.Future[calls.OptimStepResult]:
            if request.get("optimizer_params") is not None:
                raise InvalidRequestError("plexrl's gateway runs Adam only: send adam_params")
            p = request.get("adam_params") or {}
            clip = float(p.get("grad_clip_norm", 0.0))
            adam = AdamW(
                lr=float(p.get("learning_rate", 1e-4)), betas=(float(p.get("beta1", 0.9)), float(p.get("beta2", 0.95))),
                eps=float(p.get("eps", 1e-12)), weight_decay=float(p.get("weight_decay", 0.0)),
                grad_clip=clip if clip > 0 else None,
            )  # fmt: skip
            return model.job.optim_step(adam, "sum")

        result = await self.in_order(model, request.get("seq_id"), submit)
        return Json({"metrics": {"grad_norm:mean": result.grad_norm, "step:max": float(result.step)}})

    async def save_for_sampler(self, model: Model, request: dict[str, Any]) -> Outcome:
        synced = await self.in_order(model, request.get("seq_id"), model.job.sync_weights)
        model.version = synced.weight_version
        if request.get("path"):
            path = f"tinker://{model.model_id}/sampler_weights/{request['path']}"
            self._paths[path] = (model, synced.weight_version)
            return Json({"path": path, "type": "save_weights_for_sampler"})
        session = self.session(model.owner, model.session_id)
        sampler_id = f"{session.session_id}:sample:{request.get('sampling_session_seq_id', 0)}"
        self.samplers[sampler_id] = Sampler(sampler_id, model.owner, model.base_model, model.job, model,
                                            synced.weight_version)  # fmt: skip
        session.samplers.append(sampler_id)
        return Json({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

    async def save(self, model: Model, request: dict[str, Any]) -> Outcome:
        name = request.get("path") or f"step-{model.next_seq}"
        await self.in_order(model, request.get("seq_id"), lambda: model.job.save(_checkpoint(model.model_id, name)))
        return Json({"path": f"tinker://{model.model_id}/weights/{name}", "type": "save_weights"})

    async def load(self, model: Model, request: dict[str, Any]) -> Outcome:
        path = str(request["path"])

        def submit() -> asyncio.Future[calls.Loaded]:
            match = re.fullmatch(r"tinker://(.+)/weights/([^/]+)", path)
            if match is None:
                raise InvalidRequestError(f"load path {path!r}: give a tinker://<model_id>/weights/<name> path")
            return model.job.load(_checkpoint(match[1], match[2]))

        loaded = await self.in_order(model, request.get("seq_id"), submit)
        model.version = loaded.weight_version
        return Json({"path": path, "model_id": model.model_id, "type": "load_weights"})

    # -- sampling -------------------------------------------------------------------------------

    async def create_sampler(self, owner: str, request: dict[str, Any]) -> str:
        session = self.session(owner, request["session_id"])
        sampler_id = f"{session.session_id}:sample:{request['sampling_session_seq_id']}"
        path = request.get("model_path")
        if path:
            model, version = self._saved(owner, path)
            sampler = Sampler(sampler_id, owner, model.base_model, model.job, model, version, model_path=path)
        elif request.get("base_model"):
            base = str(request["base_model"])
            sampler = Sampler(sampler_id, owner, base, await self._base_job(owner, base))
        else:
            raise InvalidRequestError("create_sampling_session needs a base_model or a model_path")
        self.samplers[sampler_id] = sampler
        session.samplers.append(sampler_id)
        return sampler_id

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.owner != owner:
            raise NotFoundError(f"no sampling session {sampler_id!r} of this API key")
        return sampler

    async def sample(self, owner: str, request: dict[str, Any]) -> Outcome:
        if request.get("sampling_session_id"):
            sampler = self.sampler(owner, request["sampling_session_id"])
        elif request.get("model_path"):
            model, version = self._saved(owner, request["model_path"])
            sampler = Sampler("", owner, model.base_model, model.job, model, version)
        elif request.get("base_model"):
            sampler = Sampler("", owner, request["base_model"], await self._base_job(owner, request["base_model"]))
        else:
            raise InvalidRequestError("asample needs a sampling_session_id, a model_path or a base_model")
        if sampler.model is not None and sampler.version != sampler.model.version:
            raise InvalidRequestError(
                f"these sampler weights (version {sampler.version} of {sampler.model.model_id}) were replaced by a "
                "later save_weights_for_sampler of the same training client: plexrl serves its newest only"
            )
        prompt = wire.model_input_tokens(request["prompt"]["chunks"])
        if not len(prompt):
            raise InvalidRequestError("asample needs a non-empty prompt")
        p = request.get("sampling_params") or {}
        stop = p.get("stop")
        stop_ids: tuple[int, ...] = ()
        stop_texts: list[str] = []
        if isinstance(stop, str):
            stop_texts = [stop]
        elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
            stop_ids = tuple(int(s) for s in stop)
        elif isinstance(stop, list):
            stop_texts = [str(s) for s in stop]
        max_tokens = int(p.get("max_tokens") or DEFAULT_MAX_TOKENS)
        params = SamplingParams(
            n=int(request.get("num_samples", 1)), max_tokens=max_tokens, temperature=float(p.get("temperature", 1.0)),
            top_p=float(p.get("top_p", 1.0)), top_k=max(0, int(p.get("top_k", -1))), stop_token_ids=stop_ids,
            stop=tuple(stop_texts), seed=p.get("seed"), min_tokens=max_tokens if stop == [] else 0,
        )  # fmt: skip
        generated = sampler.job.generate([prompt], params)
        logprobs = sampler.job.logprobs([prompt]) if request.get("prompt_logprobs") and len(prompt) > 1 else None
        out = await generated
        sequences = [(s.tokens, s.logprobs, "stop" if s.finish_reason == "stop" else "length") for s in out.samples]
        prompt_logprobs = None
        if request.get("prompt_logprobs"):
            rest = (await logprobs).logprobs[0] if logprobs is not None else np.zeros(0, np.float32)
            prompt_logprobs = np.concatenate([[np.nan], rest]).astype(np.float32)
        return Proto(wire.sample_response(sequences, prompt_logprobs))

    def _saved(self, owner: str, path: str) -> tuple[Model, int]:
        saved = self._paths.get(path)
        if saved is None or saved[0].owner != owner or saved[0].model_id not in self.models:
            raise NotFoundError(
                f"no sampler weights at {path!r} (saved by save_weights_for_sampler of a live training client)"
            )
        return saved

    # -- plexrl jobs ----------------------------------------------------------------------------

    async def _open(self, owner: str, name: str, spec: calls.JobSpec) -> Job:
        """A job of ``owner``'s plexrl tenant."""
        self._jobs_opened += 1
        client = await self.tenants.client(owner)
        job_id, opened = await client.open_job(f"{name}.{self._jobs_opened}", spec)
        return Job(client, job_id, name, spec, opened)

    async def _base_job(self, owner: str, base_model: str) -> Job:
        """A never-trained job of ``base_model`` for this key's base-model samplers (its LoRA adapter
        starts at zero: it samples as the base model)."""
        key = (owner, base_model)
        if key not in self._opening:
            spec = calls.JobSpec(model=base_model, lora=LoRA(rank=1))
            self._opening[key] = asyncio.ensure_future(self._open(owner, "tinker.base", spec))
        return await self._opening[key]

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await self.finish(session.owner, session.session_id)
        for opening in self._opening.values():
            if opening.done() and not opening.exception():
                await opening.result().close()
        await self.futures.close()
        await self.tenants.close()


def _checkpoint(model_id: str, name: str) -> str:
    """A model's checkpoint folder on the worker (under the gateway's tenant folder)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", name):
        raise InvalidRequestError(f"checkpoint name {name!r}: use letters, digits, '_', '.', '-'")
    return f"tinker/{re.sub(r'[^A-Za-z0-9_.-]', '_', model_id)}/{name}"
