"""Asynchronous GRPO (``plexrl.rollout.train_async``) through real processes: the producer runs
ahead of the trainer by at most ``max_staleness`` versions (AReaL's rule, in groups), every step
reports the staleness of what it trained on, and k = 0 is synchronous."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import plexrl
from plexrl.rollout import train_async

PROMPT = [1, 5, 6, 7]
PARAMS = plexrl.SamplingParams(max_tokens=5, temperature=1.0)
GROUP, PER_STEP, STEPS = 3, 2, 4


async def agent(job: plexrl.Job) -> plexrl.Trajectory:
    """Two turns with a tool's observation between them."""
    traj = job.trajectory(PROMPT, max_turns=2)
    while await traj.generate(PARAMS) is not None:
        await asyncio.sleep(0)  # the tool
        traj.observe([3, 4], ok=True)
    return traj


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [0, 1])
async def test_the_producer_runs_at_most_k_versions_ahead_and_each_step_reports_staleness(
    tiny_model: Path, k: int
) -> None:
    started: list[int] = []

    async def group(index: int) -> tuple[list[plexrl.Trajectory], list[float]]:
        started.append(index)
        trajs = list(await asyncio.gather(*(agent(job) for _ in range(GROUP))))
        return trajs, [float(np.mean(t.turns[0].tokens == 5)) for t in trajs]

    lora = plexrl.LoRA(rank=4)
    async with plexrl.local(workers=1), plexrl.job("async", model=tiny_model, lora=lora, max_staleness=k) as job:
        steps = []
        async for step in train_async(job, group, groups_per_step=PER_STEP, steps=STEPS):
            # AReaL's bound: groups started <= (k + version + 1) x groups per step
            assert len(started) <= (k + step.version + 1) * PER_STEP
            steps.append(step)
        assert len((await job.generate([PROMPT], PARAMS)).samples) == 1  # groups left in flight were cancelled cleanly
    assert [s.version for s in steps] == list(range(1, STEPS + 1))
    assert all(len(s.groups) == PER_STEP and len(s.rewards) == PER_STEP * GROUP for s in steps)
    assert len({g for s in steps for g in s.groups}) == PER_STEP * STEPS  # no group trained twice
    staleness = [s.result.metrics["staleness_max"] for s in steps]
    assert all(0 <= x <= k for x in staleness)
    if k:
        assert max(staleness) == k  # the producer did run ahead: later steps trained on older samples
