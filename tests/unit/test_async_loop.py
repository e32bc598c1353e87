"""``train_async``'s loop on a stand-in job (no processes): completion order, the admission bound,
a failing group surfacing at the trainer, and nothing left running after the last step."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from plexrl.client.job import Optimized
from plexrl.client.trajectory import Trajectory, Turn
from plexrl.protocol.calls import Synced
from plexrl.rollout import train_async


class StandInJob:
    """Just what ``train_async`` calls: ``spec.max_staleness``, ``optimize`` and ``sync_weights``."""

    def __init__(self, max_staleness: int) -> None:
        self.spec = SimpleNamespace(max_staleness=max_staleness)
        self.version = 0
        self.trained: list[list[int]] = []  # per step: the rows' weight versions

    async def optimize(self, batch: Any, loss: str, config: Any) -> Optimized:
        self.trained.append(batch.weight_versions_B.tolist())
        return Optimized(0.0, 0, self.version + 1, 0.0, {})

    async def sync_weights(self) -> Synced:
        self.version += 1
        return Synced(self.version)


def trajectory(job: StandInJob) -> Trajectory:
    traj = Trajectory(job, np.array([1, 2], np.int32))  # type: ignore[arg-type]
    traj.turns.append(Turn(np.array([3], np.int32), np.array([-0.5], np.float32), job.version, "stop", 2, None))
    return traj


@pytest.mark.asyncio
async def test_the_trainer_takes_groups_in_completion_order_within_the_admission_bound() -> None:
    job = StandInJob(max_staleness=1)
    release = {i: asyncio.Event() for i in range(8)}
    started: list[int] = []
    reached = {4: asyncio.Event(), 6: asyncio.Event()}  # set once that many groups have started

    async def group(index: int) -> tuple[list[Trajectory], list[float]]:
        started.append(index)
        if len(started) in reached:
            reached[len(started)].set()
        trajs = [trajectory(job), trajectory(job)]
        await release[index].wait()
        return trajs, [0.0, 1.0]

    steps = train_async(job, group, groups_per_step=2, steps=2)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(steps))
    await asyncio.wait_for(reached[4].wait(), 5)  # (k + version + 1) x 2 groups may start at version 0
    for _ in range(10):
        await asyncio.sleep(0)  # let the producer try for more
    assert started == [0, 1, 2, 3]
    release[3].set()
    release[1].set()
    async with asyncio.timeout(5):
        step = await first
    assert step.groups == [3, 1] and step.version == 1  # completion order, not index order
    await asyncio.wait_for(reached[6].wait(), 5)  # version 1 lets two more start
    for _ in range(10):
        await asyncio.sleep(0)
    assert started == [0, 1, 2, 3, 4, 5]
    release[0].set()
    release[5].set()
    async with asyncio.timeout(5):
        step = await anext(steps)
        await steps.aclose()  # the groups still in flight are cancelled
    assert step.groups == [0, 5] and job.trained == [[0, 0, 0, 0], [0, 0, 1, 1]]


@pytest.mark.asyncio
async def test_a_failing_group_fails_the_trainer_and_nothing_is_left_running() -> None:
    job = StandInJob(max_staleness=0)
    waiting: list[asyncio.Future[None]] = []

    async def group(index: int) -> tuple[list[Trajectory], list[float]]:
        if index == 1:
            raise ValueError("the tool broke")
        future = asyncio.get_running_loop().create_future()
        waiting.append(future)
        await future  # never completes: cancelled when the loop ends
        return [trajectory(job)], [0.0]

    with pytest.raises(ValueError, match="the tool broke"):
        async with asyncio.timeout(5):
            async for _ in train_async(job, group, groups_per_step=2, steps=3):  # type: ignore[arg-type]
                pass
    assert waiting and all(f.cancelled() for f in waiting)
    assert job.trained == []  # no step was half taken


@pytest.mark.asyncio
async def test_a_group_that_completes_more_than_k_versions_behind_is_dropped_and_replaced() -> None:
    job = StandInJob(max_staleness=1)
    release = {i: asyncio.Event() for i in range(6)}
    started = {i: asyncio.Event() for i in range(6)}

    async def group(index: int) -> tuple[list[Trajectory], list[float]]:
        trajs = [trajectory(job), trajectory(job)]  # sampled at the version it starts under
        started[index].set()
        await release[index].wait()
        return trajs, [0.0, 1.0]

    steps = train_async(job, group, groups_per_step=1, steps=3)  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        first = asyncio.ensure_future(anext(steps))
        await started[1].wait()  # k = 1: groups 0 and 1 start at version 0
        release[0].set()
        assert (await first).groups == [0]  # version 1
        second = asyncio.ensure_future(anext(steps))
        await started[2].wait()  # started at version 1
        release[2].set()
        assert (await second).groups == [2]  # version 2: group 1 (version 0) is now 2 behind
        third = asyncio.ensure_future(anext(steps))
        await started[3].wait()
        release[1].set()  # completes too stale: dropped, and its place goes to a new group
        await started[4].wait()
        release[4].set()
        step = await third
        await steps.aclose()
    assert step.groups == [4] and step.dropped == 1
    assert job.trained == [[0, 0], [1, 1], [2, 2]]  # every trained row within k = 1 of the trainer
