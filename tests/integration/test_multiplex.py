"""The plex policy on a real worker whose device budget holds one job's state: jobs take turns,
their state moves out and in for real, and each job learns exactly as it does alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import plexrl
from plexrl.protocol.calls import JobSpec, Open, Opened
from plexrl.protocol.messages import JobInfo

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 3]]
SAMPLING = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)


def state_bytes(model: Path) -> int:
    from plexrl.worker.engine import Engine

    opened = Engine().execute("probe", Open(JobSpec(model=str(model), lora=plexrl.LoRA(rank=4))))
    assert isinstance(opened, Opened)
    return opened.state_bytes


async def agent(model: Path, name: str, seed: int, steps: int, tool_s: float) -> tuple[np.ndarray, JobInfo]:
    """A small agentic GRPO job: generate, a tool call off the accelerator, train, publish."""
    async with plexrl.job(
        name, model=model, lora=plexrl.LoRA(rank=4), optimizer=plexrl.AdamW(lr=5e-2), seed=seed
    ) as job:
        for _ in range(steps):
            out = await job.generate(PROMPTS, SAMPLING)
            await asyncio.sleep(tool_s)  # the tool: the device is free for other jobs meanwhile
            rewards = [float(np.sum(np.asarray(s.tokens) == 5)) for s in out.samples]
            await job.optimize(plexrl.grpo_batch(PROMPTS, out, rewards), loss="grpo")
            await job.sync_weights()
        logprobs = (await job.logprobs(PROMPTS)).logprobs.values
        return logprobs, await job.stats()


@pytest.mark.asyncio
async def test_jobs_sharing_a_one_job_budget_swap_state_and_learn_exactly_as_alone(tiny_model: Path) -> None:
    size = state_bytes(tiny_model)
    async with plexrl.local(workers=1):
        alone, alone_stats = await agent(tiny_model, "alone", seed=7, steps=3, tool_s=0.0)
    budget = int(1.5 * size)  # one job's state fits on the device, two do not
    async with plexrl.local(workers=1, policy="plex", memory_budget_bytes=budget) as client:
        runs = await asyncio.gather(*(agent(tiny_model, f"j{seed}", seed, steps=3, tool_s=0.05) for seed in (7, 8, 9)))
        status = await client.status()
    (shared, _), *others = runs
    np.testing.assert_array_equal(shared, alone)  # same seed, same updates: bit-identical
    assert all(not np.array_equal(lp, alone) for lp, _ in others)  # (other seeds learn otherwise)
    assert alone_stats.swaps == 0 and alone_stats.state_bytes == size
    for _, s in runs:
        assert s.swaps > 0 and s.swap_bytes > 0, "every job had to leave the device for the others"
        assert 0 < s.accelerator_s < s.wall_s
    assert status.workers[0].state_bytes_on_device <= budget
