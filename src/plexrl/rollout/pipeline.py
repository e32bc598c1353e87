"""RolloutPipe: complete GRPO groups stream to the trainer while later groups still generate.

``job.rollout(prompts, n=G, reward=fn)`` is an async iterator of :class:`Group`, each yielded the
moment its last sample's reward exists (rewards may be async: a verifier that awaits a tool),
with its group-normalised advantages. :func:`train` consumes groups FIFO as they arrive
(``forward_backward`` per ``per_call`` groups, gradients accumulating) and takes one
``optim_step`` once all have arrived. The sampler's weights stay fixed for the whole rollout, and
the trainer refuses any sample of another version (``StaleSamplesError``): on-policy by
construction. With a disaggregated job (``placement="disaggregated"``) training runs on its home
worker while generation goes on on its sampler worker.

Admission. The rollout's ``len(prompts) * n`` sequences go to the sampler in generate calls of
``chunk`` sequences. ``admission="frontier"`` (frontier-group dispatch) orders them group by
group in tiers of ``frontier`` groups and gives each call its tier as priority, so the groups the
trainer needs next are admitted first and the rest backfill as slots free (the scheduler
dispatches a job's generates by priority; a vLLM worker also passes it to vLLM's scheduler).
Tiers rather than one group at a time: with heavy-tailed lengths a rollout lasts as long as its
longest group takes from its admission, and a strict group order admits the last groups (long
ones among them) only once nearly every slot has drained, which lengthens the rollout's tail
(seen on ``sum``: the strict order lost to the interleaved one by 20-40%). ``admission="arrival"`` interleaves the groups
(sample 1 of every group, then sample 2, ...), as a router fanning out independent requests
does, with no priority: the same work, in the order an engine would otherwise see it.

Metrics (:class:`RolloutMetrics`, on client time): rollout-to-train-end (first admission to the
end of the optimizer step) and the trainer waiting ratio (time the trainer was ready but had no
complete group, over that window).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import msgspec
import numpy as np

from plexrl.errors import InvalidRequestError
from plexrl.protocol.calls import ForwardBackwardResult, Generated, OptimStepResult
from plexrl.rollout.advantages import group_advantages
from plexrl.types import Batch, LossConfig, Sample, SamplingParams

if TYPE_CHECKING:
    from plexrl.client.job import Job

R = TypeVar("R")
Reward = Callable[[int, Sample], float | Awaitable[float]]  # (prompt index, sample) -> reward
ADMISSIONS = ("frontier", "arrival")


@dataclass(frozen=True)
class Group:
    """The ``n`` samples of one prompt, scored, with their group-normalised advantages."""

    index: int  # the prompt's index in the rollout
    prompt: np.ndarray
    samples: list[Sample]  # prompt_index 0: this group's own prompt
    rewards: np.ndarray
    advantages: np.ndarray

    @property
    def weight_version(self) -> int:
        return self.samples[0].weight_version

    def batch(self) -> Batch:
        return Batch.from_samples([self.prompt], self.samples, self.advantages)


@dataclass
class RolloutMetrics:
    """Client-clock timestamps of one rollout and the training on it (``time.perf_counter``)."""

    started_s: float = 0.0  # the first generate call submitted
    group_ready_s: list[float] = field(default_factory=list)  # each yielded group, in order
    dropped: int = 0  # groups left out by the zero-variance filter
    trainer_busy: list[tuple[float, float]] = field(default_factory=list)  # forward_backward / optim_step calls
    train_end_s: float | None = None  # the optimizer step done

    @property
    def rollout_to_train_end_s(self) -> float:
        if self.train_end_s is None:
            raise RuntimeError("the rollout has not been trained on yet (plexrl.rollout.train)")
        return self.train_end_s - self.started_s

    @property
    def trainer_waiting_ratio(self) -> float:
        """Time the trainer had nothing to run (ready, no complete group) over rollout-to-train-end."""
        window = self.rollout_to_train_end_s
        busy = _union_s(self.trainer_busy, self.started_s, self.started_s + window)
        return max(0.0, window - busy) / window if window > 0 else 0.0


class Rollout:
    """``async for group in job.rollout(prompts, n=8, reward=fn): ...`` (see the module docstring)."""

    def __init__(
        self,
        job: Job,
        prompts: Sequence[Sequence[int] | np.ndarray],
        n: int,
        reward: Reward,
        *,
        params: SamplingParams | None = None,
        chunk: int | None = None,
        admission: str = "frontier",
        frontier: int | None = None,
        drop_zero_variance: bool = False,
    ) -> None:
        if n < 2:
            raise InvalidRequestError(f"n={n}: a GRPO group needs at least 2 samples per prompt")
        if admission not in ADMISSIONS:
            raise InvalidRequestError(f"admission={admission!r}: choose one of {', '.join(ADMISSIONS)}")
        if not prompts:
            raise InvalidRequestError("a rollout needs at least one prompt")
        self.job = job
        self.prompts = [np.asarray(p, np.int32) for p in prompts]
        self.n = n
        self.reward = reward
        self.params = msgspec.structs.replace(params or SamplingParams(), n=1)
        self.params.validate()
        self.chunk = chunk or n
        if self.chunk < 1:
            raise InvalidRequestError(f"chunk={chunk}: a generate call needs at least one sequence")
        self.admission = admission
        # Groups admitted together ahead of the rest: by default a quarter of the rollout.
        if frontier is not None and frontier < 1:
            raise InvalidRequestError(f"frontier={frontier}: a tier holds at least one group")
        self.frontier = frontier or max(1, len(self.prompts) // 4)
        self.drop_zero_variance = drop_zero_variance
        self.metrics = RolloutMetrics()
        self.groups: list[Group] = []  # those yielded so far, in order
        self._ready: asyncio.Queue[Group | BaseException | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def __aiter__(self) -> AsyncIterator[Group]:
        return self._groups()

    async def _groups(self) -> AsyncIterator[Group]:
        if self._task is not None:
            raise InvalidRequestError("a rollout is iterated once: make a new one with job.rollout(...)")
        self._task = asyncio.ensure_future(self._run())
        try:
            while (item := await self._ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                self.groups.append(item)
                yield item
        finally:
            if not self._task.done():
                self._task.cancel()

    def order(self) -> list[tuple[int, int]]:
        """(group, sample) pairs in admission order."""
        groups, n = range(len(self.prompts)), range(self.n)
        if self.admission == "frontier":
            return [(g, k) for g in groups for k in n]
        return [(g, k) for k in n for g in groups]

    def calls(self) -> list[tuple[list[int], int]]:
        """The generate calls, in submission order: each call's group per row, and its priority."""
        order = self.order()
        plan = []
        for start in range(0, len(order), self.chunk):
            rows = [g for g, _ in order[start : start + self.chunk]]
            plan.append((rows, rows[0] // self.frontier if self.admission == "frontier" else 0))
        return plan

    async def _run(self) -> None:
        try:
            await self._generate_and_score()
        except Exception as e:  # a failed call or reward: the consumer raises it at its next step
            self._ready.put_nowait(e)
            return
        self._ready.put_nowait(None)

    async def _generate_and_score(self) -> None:
        pending: dict[asyncio.Future[Generated], list[int]] = {}  # call -> the group of each of its rows
        self.metrics.started_s = time.perf_counter()
        for rows, priority in self.calls():
            pending[self.job.generate([self.prompts[g] for g in rows], self.params, priority=priority)] = rows
        scored: list[list[tuple[Sample, asyncio.Task[float]]]] = [[] for _ in self.prompts]
        groups: list[asyncio.Task[None]] = []
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    rows = pending.pop(fut)
                    for sample in fut.result().samples:
                        group = rows[sample.prompt_index]
                        own = Sample(0, sample.tokens, sample.logprobs, sample.finish_reason, sample.weight_version)
                        scored[group].append((own, asyncio.ensure_future(self._score(group, own))))
                    for group in sorted(set(rows)):
                        if len(scored[group]) == self.n:
                            groups.append(asyncio.ensure_future(self._complete(group, scored[group])))
            await asyncio.gather(*groups)
        finally:  # the consumer stopped early, or a call or a reward failed: cancel what is left
            scores = [task for members in scored for _, task in members]
            left: list[asyncio.Future[Generated] | asyncio.Task[None] | asyncio.Task[float]] = [
                *pending, *groups, *scores
            ]  # fmt: skip
            for task in left:
                task.cancel()

    async def _score(self, group: int, sample: Sample) -> float:
        value = self.reward(group, sample)
        return float(await value) if inspect.isawaitable(value) else float(value)

    async def _complete(self, group: int, scored: list[tuple[Sample, asyncio.Task[float]]]) -> None:
        rewards = np.array([await task for _, task in scored], np.float32)
        if self.drop_zero_variance and np.all(rewards == rewards[0]):
            self.metrics.dropped += 1
            return
        members = [s for s, _ in scored]
        advantages = group_advantages(rewards, np.zeros(len(members), np.int32))
        self.metrics.group_ready_s.append(time.perf_counter())
        self._ready.put_nowait(Group(group, self.prompts[group], members, rewards, advantages))


async def train(
    job: Job,
    groups: AsyncIterable[Group] | Sequence[Group],
    *,
    per_call: int = 1,
    loss: str = "grpo",
    loss_config: LossConfig | None = None,
    metrics: RolloutMetrics | None = None,
) -> OptimStepResult:
    """Train on groups FIFO as they come: a ``forward_backward`` every ``per_call`` groups (the
    gradients accumulate), one ``optim_step`` once the groups have run out and every
    ``forward_backward`` succeeded. Returns the step.

    Each ``forward_backward`` is submitted the moment its groups are in, without waiting for the
    one before (the job's trainer lane runs them in order), so the trainer never idles on a round
    trip: a list of groups given at once goes to the trainer as one back-to-back batch of calls,
    the same calls a rollout streams. The trainer's busy time and end go to ``metrics`` (a
    ``Rollout``'s own by default); a call counts as busy from its submission, or from the end of
    the call before it, to its answer.
    """
    if per_call < 1:
        raise InvalidRequestError(f"per_call={per_call}: train on at least one group per call")
    if metrics is None and isinstance(groups, Rollout):
        metrics = groups.metrics
    busy = metrics.trainer_busy if metrics is not None else []
    pending: list[Group] = []
    calls: list[asyncio.Future[ForwardBackwardResult]] = []
    previous_end: list[float] = [0.0]  # the answer time of the call submitted before

    async def timed(call: Awaitable[R], after: asyncio.Future[ForwardBackwardResult] | None) -> R:
        submitted = time.perf_counter()
        result = await call
        end = time.perf_counter()
        if after is not None and not after.done():
            await after
        busy.append((max(submitted, previous_end[0]), end))
        previous_end[0] = end
        return result

    def submit(batch: list[Group]) -> None:
        merged = _concat([g.batch() for g in batch])
        before = calls[-1] if calls else None
        calls.append(asyncio.ensure_future(timed(job.forward_backward(merged, loss, loss_config), before)))

    try:
        async for group in _as_async(groups):
            pending.append(group)
            if len(pending) == per_call:
                submit(pending)
                pending = []
        if pending:
            submit(pending)
        if not calls:
            raise InvalidRequestError("no group to train on (all dropped as zero-variance?): nothing was applied")
        await asyncio.gather(*calls)
    finally:
        for call in calls:
            call.cancel()
    result = await timed(job.optim_step(), None)
    if metrics is not None:
        metrics.train_end_s = previous_end[0]
    return result


async def _as_async(groups: AsyncIterable[Group] | Sequence[Group]) -> AsyncIterator[Group]:
    if isinstance(groups, Sequence):
        for g in groups:
            yield g
    else:
        async for g in groups:
            yield g


def _concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    from plexrl.types import Ragged

    def cat(rows: list[Ragged]) -> Ragged:
        return Ragged.from_rows([r for b in rows for r in b], rows[0].values.dtype.name)

    return Batch(
        tokens=cat([b.tokens for b in batches]),
        prompt_lens_B=np.concatenate([b.prompt_lens_B for b in batches]),
        sampler_logprobs=cat([b.sampler_logprobs for b in batches if b.sampler_logprobs is not None]),
        advantages_B=np.concatenate([b.advantages_B for b in batches if b.advantages_B is not None]),
        weight_versions_B=np.concatenate([b.weight_versions_B for b in batches if b.weight_versions_B is not None]),
    )


def _union_s(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by ``intervals``."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total
