"""A job handle: its calls are submitted at once and execute in submission order.

``job.forward_backward(...)`` returns a future immediately, so a script may submit
``forward_backward`` and ``optim_step`` before awaiting either (Tinker's pipelining).
``plexrl.job(...)`` opens a job, makes it the current one for ``plexrl.generate`` and friends,
and closes it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import msgspec
import numpy as np

from plexrl.client.connection import Client, current_client
from plexrl.client.trajectory import Trajectory
from plexrl.errors import InvalidRequestError, JobClosedError, NoJobContextError, PlexError, UnknownJobError
from plexrl.names import Placement
from plexrl.protocol import calls
from plexrl.protocol.messages import JobInfo, TurnOf
from plexrl.rollout.pipeline import Reward, Rollout
from plexrl.types import AdamW, Batch, LoRA, LossConfig, Ragged, SamplingParams

if TYPE_CHECKING:
    from plexrl.endpoint import Endpoint
    from plexrl.text import Renderer

current_job: contextvars.ContextVar[Job | None] = contextvars.ContextVar("plexrl_job", default=None)

R = TypeVar("R")
Prompts = Ragged | Sequence[Sequence[int] | np.ndarray]


class Optimized(msgspec.Struct, frozen=True):
    """What ``optimize`` did: the loss of the batch and the optimizer step it applied."""

    loss: float
    num_tokens: int
    step: int
    grad_norm: float
    metrics: dict[str, float]


class Job:
    def __init__(
        self,
        client: Client,
        job_id: str,
        name: str,
        spec: calls.JobSpec,
        opened: calls.Opened,
        next_seq: int = 1,
        generates: int = 0,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.name = name
        self.spec = spec
        self.trainable_params = opened.trainable_params
        self._closed = False
        # Its calls' numbers in submission order (a resumed client learns which the job holds), and
        # its generates': each is seeded by its index unless it names a seed, so a generate sent
        # again (after a worker's death or a coordinator restart) samples the same tokens.
        self._seqs = itertools.count(next_seq)
        self._generates = itertools.count(generates)
        self._trajectories = itertools.count()  # names its trajectories (a pooled job routes their turns)
        client.jobs[job_id] = self

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, model={self.spec.model!r})"

    def generate(
        self, prompts: Prompts, params: SamplingParams | None = None, *, priority: int = 0
    ) -> asyncio.Future[calls.Generated]:
        """Sample ``params.n`` completions per prompt (token ids) with the sampler's weights.
        ``priority``: among this job's queued generates, lower is admitted first."""
        return self._generate(prompts, params, priority)

    def _generate(
        self, prompts: Prompts, params: SamplingParams | None, priority: int, turn: TurnOf | None = None
    ) -> asyncio.Future[calls.Generated]:
        params = params or SamplingParams()
        params.validate()
        if params.seed is None:
            params = msgspec.structs.replace(params, seed=calls.generate_seed(self.spec.seed, next(self._generates)))
        else:
            next(self._generates)
        rows = prompts if isinstance(prompts, Ragged) else Ragged.from_rows(prompts, "int32")
        return self._submit(calls.Generate(prompts=rows, params=params), calls.Generated, priority, turn)

    def rollout(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        n: int,
        reward: Reward,
        *,
        params: SamplingParams | None = None,
        chunk: int | None = None,
        admission: str = "frontier",
        frontier: int | None = None,
        drop_zero_variance: bool = False,
    ) -> Rollout:
        """Sample ``n`` completions of each prompt and yield each group once all its rewards are in
        (``async for group in job.rollout(...)``); see :mod:`plexrl.rollout.pipeline`."""
        return Rollout(
            self, prompts, n, reward, params=params, chunk=chunk, admission=admission, frontier=frontier,
            drop_zero_variance=drop_zero_variance,
        )  # fmt: skip

    def trajectory(
        self,
        prompt: Sequence[int] | np.ndarray,
        *,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        turn_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Trajectory:
        """A multi-turn trajectory from ``prompt`` (token ids): its ``generate`` calls are the turns,
        ``observe`` appends a tool's tokens between them; see :mod:`plexrl.client.trajectory`.
        Budgets: at most ``max_turns`` turns, ``max_tokens`` tokens in all (prompt, turns and
        observations), ``turn_timeout_s`` per turn, ``timeout_s`` from now to the last turn's end."""
        return Trajectory(
            self, np.asarray(prompt, np.int32).reshape(-1), f"t{next(self._trajectories)}", max_turns=max_turns,
            max_tokens=max_tokens,
            turn_timeout_s=turn_timeout_s, timeout_s=timeout_s,
        )  # fmt: skip

    def openai(
        self,
        renderer: Renderer | None = None,
        *,
        tool_parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens: int = 512,
        trajectory_max_tokens: int | None = None,
    ) -> Endpoint:
        """An OpenAI-compatible endpoint for this job (``async with job.openai() as endpoint``):
        ``/v1/chat/completions`` (tools parsed by ``tool_parser``: ``hermes`` or ``tags``),
        ``/v1/completions`` and ``/v1/models`` at ``endpoint.base_url``, for ``endpoint.api_key``;
        each session's turns recorded as a token-exact trajectory (``endpoint.finish(session)``).
        ``renderer``: how messages become tokens (default: the model directory's tokenizer and chat
        template, loaded here); ``max_tokens``: a reply's budget when a request names none;
        ``trajectory_max_tokens``: a session's in all. See :mod:`plexrl.endpoint`."""
        from plexrl.endpoint import Endpoint

        return Endpoint(self, renderer, tool_parser=tool_parser, host=host, port=port, max_tokens=max_tokens,
                        trajectory_max_tokens=trajectory_max_tokens)  # fmt: skip

    def logprobs(self, tokens: Prompts) -> asyncio.Future[calls.LogprobsResult]:
        rows = tokens if isinstance(tokens, Ragged) else Ragged.from_rows(tokens, "int32")
        return self._submit(calls.Logprobs(tokens=rows), calls.LogprobsResult)

    def forward_backward(
        self, batch: Batch, loss: str = "grpo", loss_config: LossConfig | None = None
    ) -> asyncio.Future[calls.ForwardBackwardResult]:
        """Accumulate the gradient of ``loss`` on ``batch``; applied by the next ``optim_step``.

        Rows whose loss is zero at every token (a GRPO group whose rewards were all equal gets
        advantage 0) are not run through the model: the gradient and the token count, hence the
        step, are those a run through them would give, without the compute."""
        batch.validate(loss)
        call = calls.ForwardBackward(batch=batch, loss=loss, loss_config=loss_config or LossConfig())
        return self._submit(call, calls.ForwardBackwardResult)

    def forward(
        self, batch: Batch, loss: str = "cross_entropy", loss_config: LossConfig | None = None
    ) -> asyncio.Future[calls.ForwardBackwardResult]:
        """The loss on ``batch`` and each completion token's logprob (``result.logprobs``) under the
        trainer's weights, accumulating no gradient."""
        batch.validate(loss)
        call = calls.ForwardBackward(batch=batch, loss=loss, loss_config=loss_config or LossConfig(),
                                     forward_only=True, return_logprobs=True)  # fmt: skip
        return self._submit(call, calls.ForwardBackwardResult)

    def optim_step(self, adam: AdamW | None = None, reduction: str = "mean") -> asyncio.Future[calls.OptimStepResult]:
        """Apply the gradients accumulated since the last step: of the mean loss over their tokens, or
        (``reduction="sum"``) of the summed loss; with the job's AdamW, or ``adam``'s for this step."""
        if reduction not in ("mean", "sum"):
            raise InvalidRequestError(f"optim_step reduction {reduction!r}: choose mean or sum")
        return self._submit(calls.OptimStep(adam=adam, reduction=reduction), calls.OptimStepResult)

    async def optimize(self, batch: Batch, loss: str = "grpo", loss_config: LossConfig | None = None) -> Optimized:
        """``forward_backward`` then ``optim_step``, both submitted before either is awaited."""
        fb = self.forward_backward(batch, loss, loss_config)
        step = self.optim_step()
        fb_result, step_result = await asyncio.gather(fb, step)
        return Optimized(
            fb_result.loss, fb_result.num_tokens, step_result.step, step_result.grad_norm, fb_result.metrics
        )

    def sync_weights(self) -> asyncio.Future[calls.Synced]:
        """Publish the trainer's weights to the sampler (weight version + 1)."""
        return self._submit(calls.SyncWeights(), calls.Synced)

    def save(self, path: str | os.PathLike[str]) -> asyncio.Future[calls.Saved]:
        """Checkpoint trainer weights and optimizer state atomically to ``path``, relative to your
        checkpoint folder on the worker's host (``--checkpoint-root``/<your key's name>; the
        result's ``path`` says where). Absolute paths and '..' get ``CheckpointPathError``."""
        return self._submit(calls.Save(path=os.fspath(path)), calls.Saved)

    def export(self, path: str | os.PathLike[str], format: str = "peft") -> asyncio.Future[calls.Saved]:
        """Write the trainer's weights where ``save`` would, for other tools: ``format="peft"``, a PEFT
        adapter directory (``PeftModel.from_pretrained(base, dir)``; vLLM serves it as a LoRA), or
        ``"hf"``, the base model with them merged in (``AutoModelForCausalLM.from_pretrained(dir)``,
        ``vllm serve dir``). ``sync_weights`` first to export what ``generate`` samples with."""
        if format not in ("peft", "hf"):
            raise InvalidRequestError(f"export format {format!r}: choose 'peft' (an adapter) or 'hf' (a merged model)")
        return self._submit(calls.Save(path=os.fspath(path), format=format), calls.Saved)

    def load(self, path: str | os.PathLike[str]) -> asyncio.Future[calls.Loaded]:
        """Restore a checkpoint saved by one of your jobs (``path`` as given to ``save``)."""
        return self._submit(calls.Load(path=os.fspath(path)), calls.Loaded)

    async def stats(self) -> JobInfo:
        """The coordinator's accounting for this job: accelerator-seconds, swaps, where its state is."""
        status = await self.client.status()
        for info in status.jobs:
            if info.job_id == self.job_id:
                return info
        raise JobClosedError(f"job {self.job_id!r} is not open on the coordinator")

    async def close(self) -> None:
        """Free the job's state on its worker. A no-op once the coordinator is gone (so is the job)."""
        if self._closed or self.client.lost:
            return
        self._closed = True
        try:
            await self._submit(calls.Close(), calls.Closed)
        finally:
            self.client.jobs.pop(self.job_id, None)

    def _submit(
        self, call: calls.Call, result_type: type[R], priority: int = 0, turn: TurnOf | None = None
    ) -> asyncio.Future[R]:
        return self.client.submit(self.job_id, call, result_type, priority, seq=next(self._seqs), turn=turn)


@asynccontextmanager
async def job(
    name: str,
    model: str | os.PathLike[str],
    *,
    lora: LoRA | None = LoRA(),
    optimizer: AdamW = AdamW(),
    seed: int = 0,
    weight: float = 1.0,
    placement: Placement = "colocated",
    max_staleness: int = 0,
    gradient_checkpointing: bool | None = None,
    devices: int = 1,
    client: Client | None = None,
    reattach: bool = False,
) -> AsyncIterator[Job]:
    """Open a job on the current client (``plexrl.local`` / ``plexrl.connect``), close it on exit.

    ``lora=None`` trains a full copy of the model instead of an adapter. ``weight`` is the job's
    share of accelerator time under the ``plex`` policy, relative to other jobs (2.0: twice).
    ``placement="disaggregated"`` runs its generates on another worker than its training (a
    replica of its sampler there, new weights pushed on every ``sync_weights``), so sampling and
    training overlap; ``"pooled"`` runs them on the cluster's rollout workers (``plexrl worker
    --role rollout``), each turn of a ``job.trajectory`` in the bucket its signals so far call
    for (Libra); ``"colocated"`` (default) keeps both on one worker. ``max_staleness=k``
    trains on samples of weights up to ``k`` versions old (0, the default: strictly on-policy);
    pair it with :class:`plexrl.rollout.StalenessGate` to bound what is in flight.
    ``gradient_checkpointing`` recomputes the decoder layers' activations in the backward instead
    of keeping them (less memory per trained token, about a third more compute); None, the default,
    turns it on for models of 100M parameters or more.
    ``devices=N`` (2, 4 or 8) trains it on N workers of one node at once, a gang its calls run on
    together: a full fine-tune sharded over them (FSDP2: each holds 1/N of its weights, gradients
    and optimizer state, so a model too large for one worker's memory trains), a LoRA job data
    parallel (each runs 1/N of a call's rows). Its generates run on the first of them; the gang
    is time-sliced with other jobs as one.
    ``reattach=True`` first takes over this key's job ``name`` whose client went away (a restarted
    script; see ``Client.reattach``), and opens a new one only if there is none.
    """
    client = client or current_client.get()
    if client is None:
        raise NoJobContextError(
            "plexrl.job(...) needs a cluster: wrap it in `async with plexrl.local():` or plexrl.connect(...)"
        )
    model_path = os.path.abspath(model) if os.path.exists(model) else os.fspath(model)
    spec = calls.JobSpec(
        model=model_path,
        lora=lora,
        optimizer=optimizer,
        seed=seed,
        max_staleness=max_staleness,
        gradient_checkpointing=gradient_checkpointing,
    )
    handle: Job | None = None
    if reattach:
        with contextlib.suppress(UnknownJobError):
            handle = await client.reattach(name)
    if handle is None:
        job_id, opened = await client.open_job(name, spec, weight, placement, devices)
        handle = Job(client, job_id, name, spec, opened)
    token = current_job.set(handle)
    try:
        yield handle
    except BaseException:
        current_job.reset(token)
        with contextlib.suppress(PlexError):  # the body's error is the one to report
            await handle.close()
        raise
    current_job.reset(token)
    await handle.close()


def _current() -> Job:
    handle = current_job.get()
    if handle is None:
        raise NoJobContextError(
            "no current job: call this inside `async with plexrl.job(...)`, or use the explicit job.generate(...) form"
        )
    return handle


def generate(prompts: Prompts, params: SamplingParams | None = None) -> asyncio.Future[calls.Generated]:
    """``generate`` on the job of the enclosing ``async with plexrl.job(...)``."""
    return _current().generate(prompts, params)


async def optimize(batch: Batch, loss: str = "grpo", loss_config: LossConfig | None = None) -> Optimized:
    """``forward_backward`` + ``optim_step`` on the current job."""
    return await _current().optimize(batch, loss, loss_config)


def forward_backward(
    batch: Batch, loss: str = "grpo", loss_config: LossConfig | None = None
) -> asyncio.Future[calls.ForwardBackwardResult]:
    return _current().forward_backward(batch, loss, loss_config)


def optim_step() -> asyncio.Future[calls.OptimStepResult]:
    return _current().optim_step()


def sync_weights() -> asyncio.Future[calls.Synced]:
    return _current().sync_weights()
