"""Asynchronous GRPO for one job: rollout and training run at once, samples at most k versions old.

    async with plexrl.job("agent", model=path, lora=lora, max_staleness=1) as job:
        async def group(index):                           # one GRPO group: n trajectories, scored
            trajs = await asyncio.gather(*(play(job, task, problem(index), params, renderer) for _ in range(8)))
            return trajs, [task.score(problem(index), completion(t, renderer)) for t in trajs]
        async for step in train_async(job, group, groups_per_step=4, steps=20):
            print(step.version, step.result.metrics["staleness_max"])

The producer keeps starting groups while the trainer trains, as far ahead as the job's
``max_staleness`` lets it (:class:`StalenessGate`, AReaL's rule, counted in groups: a group is
admitted at one version), so tool waits and long tails of one step overlap the training of the one
before. The trainer takes the first ``groups_per_step`` groups to complete, in completion order.
The gate bounds the staleness of groups consumed in admission order only: a slow group admitted
early may complete after k more steps, so a group whose oldest sampled token is more than k
versions behind when the trainer gets to it is dropped (``AsyncStep.dropped``) and its place freed
for a new one (the drop-at-consume sweep that makes the bound a guarantee). The trainer then trains
on them (``decoupled_ppo`` by default: the sampler's logprobs are the behaviour policy,
importance weights truncated), publishes the new weights, and reports what the step trained on:
its metrics hold the staleness of the sampled tokens (``staleness_mean``, ``staleness_max``, in
versions behind the trainer's). With ``max_staleness=0`` it is synchronous GRPO. Groups still in
flight when the last step is done are cancelled (their calls too).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from plexrl.client.trajectory import Trajectory
from plexrl.errors import InvalidRequestError
from plexrl.rollout.advantages import trajectory_batch
from plexrl.rollout.staleness import StalenessGate
from plexrl.types import LossConfig

if TYPE_CHECKING:
    from plexrl.client.job import Job, Optimized

Scored = tuple[int, Sequence[Trajectory], Sequence[float]]  # (group index, its trajectories, their rewards)
GroupFn = Callable[[int], Awaitable[tuple[Sequence[Trajectory], Sequence[float]]]]  # index -> (trajectories, rewards)


@dataclass(frozen=True)
class AsyncStep:
    """One optimizer step of :func:`train_async`."""

    step: int  # 1, 2, ...
    version: int  # the weight version it published
    groups: list[int]  # the indices of the groups it trained on
    rewards: list[float]  # every trajectory's reward, group by group
    result: Optimized
    dropped: int = 0  # groups that completed too stale to train on while this step gathered its own


async def train_async(
    job: Job,
    group: GroupFn,
    *,
    groups_per_step: int,
    steps: int,
    loss: str = "decoupled_ppo",
    loss_config: LossConfig | None = None,
    version: int = 0,
) -> AsyncIterator[AsyncStep]:
    """Yield each step once its weights are published; see the module docstring. ``version``: the
    job's weight version now (0 for a new job)."""
    if groups_per_step < 1 or steps < 1:
        raise InvalidRequestError(
            f"train_async needs groups_per_step >= 1 and steps >= 1 (got {groups_per_step}, {steps})"
        )
    gate = StalenessGate(job.spec.max_staleness, groups_per_step, version=version)
    done: asyncio.Queue[Scored | Exception] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def one(index: int) -> None:
        try:
            trajs, rewards = await group(index)
        except Exception as e:  # the trainer raises it at its next group
            gate.finish(accepted=False)
            done.put_nowait(e)
            return
        except BaseException:  # cancelled
            gate.finish(accepted=False)
            raise
        gate.finish(accepted=True)
        done.put_nowait((index, trajs, rewards))

    async def producer() -> None:
        for index in itertools.count():
            await gate.admit()
            task = asyncio.create_task(one(index))
            running.add(task)
            task.add_done_callback(running.discard)

    feeding = asyncio.create_task(producer())
    try:
        for step in range(1, steps + 1):
            taken: list[Scored] = []
            dropped = 0
            while len(taken) < groups_per_step:
                item = await done.get()
                if isinstance(item, Exception):
                    raise item
                oldest = min((t.weight_version for traj in item[1] for t in traj.turns), default=gate.version)
                if oldest < gate.version - gate.max_staleness:
                    gate.discard()
                    dropped += 1
                    continue
                taken.append(item)
            trajs = [t for _, ts, _ in taken for t in ts]
            rewards = [float(r) for _, _, rs in taken for r in rs]
            ids = np.concatenate([np.full(len(ts), i) for i, ts, _ in taken])
            result = await job.optimize(trajectory_batch(trajs, rewards, ids), loss, loss_config)
            synced = await job.sync_weights()
            gate.publish(synced.weight_version)
            yield AsyncStep(step, synced.weight_version, [i for i, _, _ in taken], rewards, result, dropped)
    finally:
        feeding.cancel()
        for task in list(running):
            task.cancel()
        await asyncio.gather(feeding, *running, return_exceptions=True)
