"""Complete-group pipelining through real processes: groups stream to the trainer as they finish."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import plexrl
from plexrl.errors import StaleSamplesError
from plexrl.rollout import train
from plexrl.types import Sample

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 3], [1, 4, 4, 4, 4]]
PARAMS = plexrl.SamplingParams(max_tokens=6, temperature=1.0)


async def tool_reward(prompt_index: int, sample: Sample) -> float:
    await asyncio.sleep(0.01 * (prompt_index + 1))  # a verifier that awaits a tool
    return float(np.sum(sample.tokens == 5)) + 0.1 * prompt_index


@pytest.mark.asyncio
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
async def test_a_rollout_yields_every_group_complete_scored_and_trains_on_policy(
    tiny_model: Path, placement: str
) -> None:
    async with plexrl.local(workers=2), plexrl.job("pipe", model=tiny_model, placement=placement) as job:
        rollout = job.rollout(PROMPTS, n=4, reward=tool_reward, params=PARAMS, chunk=2)
        step = await train(job, rollout, per_call=1, metrics=rollout.metrics)
        groups = rollout.groups
        assert step.step == 1
        assert sorted(g.index for g in groups) == [0, 1, 2, 3]
        for g in groups:
            assert len(g.samples) == 4 and g.weight_version == 0
            np.testing.assert_array_equal(g.prompt, PROMPTS[g.index])
            expected = [float(np.sum(s.tokens == 5)) + 0.1 * g.index for s in g.samples]
            np.testing.assert_allclose(g.rewards, expected, rtol=1e-6)
            assert abs(float(np.mean(g.advantages))) < 1e-5  # normalised within the group
        m = rollout.metrics
        assert len(m.group_ready_s) == 4 and m.started_s <= min(m.group_ready_s)
        assert m.rollout_to_train_end_s > 0 and 0 <= m.trainer_waiting_ratio < 1
        await job.sync_weights()
        with pytest.raises(StaleSamplesError):  # the old rollout is off-policy now
            await job.forward_backward(groups[0].batch())


@pytest.mark.asyncio
async def test_frontier_admission_completes_groups_in_order_and_zero_variance_groups_can_be_dropped(
    tiny_model: Path,
) -> None:
    async with plexrl.local(workers=1), plexrl.job("frontier", model=tiny_model) as job:
        order = [g.index async for g in job.rollout(PROMPTS, n=4, reward=lambda i, s: 1.0, params=PARAMS)]
        assert order == [0, 1, 2, 3]  # one worker, one call at a time: group by group
        first = job.rollout(PROMPTS, n=4, reward=lambda i, s: float(i), params=PARAMS, drop_zero_variance=True)
        assert [g async for g in first] == [] and first.metrics.dropped == 4  # every group's rewards are equal
        arrival = job.rollout(PROMPTS, n=2, reward=tool_reward, params=PARAMS, chunk=2, admission="arrival")
        assert arrival.order()[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # sample 1 of every group first
        frontier = job.rollout(PROMPTS, n=2, reward=tool_reward, params=PARAMS, chunk=2)
        assert frontier.order()[:4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        # Tiers of `frontier` groups: each tier is admitted ahead of the next; arrival has no priority.
        tiered = job.rollout(PROMPTS, n=2, reward=tool_reward, params=PARAMS, chunk=2, frontier=2)
        assert tiered.calls() == [([0, 0], 0), ([1, 1], 0), ([2, 2], 1), ([3, 3], 1)]
        assert [p for _, p in frontier.calls()] == [0, 1, 2, 3]  # default: a quarter of the 4 groups each
        assert {p for _, p in arrival.calls()} == {0}
        with pytest.raises(plexrl.errors.InvalidRequestError, match="at least one group"):
            job.rollout(PROMPTS, n=2, reward=tool_reward, frontier=0)
        with pytest.raises(plexrl.errors.InvalidRequestError, match="at least 2"):
            job.rollout(PROMPTS, n=1, reward=tool_reward)

        def broken(i: int, s: Sample) -> float:
            raise ValueError(f"verifier crashed on prompt {i}")

        failing = job.rollout(PROMPTS, n=2, reward=broken, params=PARAMS)
        with pytest.raises(ValueError, match="verifier crashed"):  # the reward's error reaches the consumer
            _ = [g async for g in failing]
        with pytest.raises(plexrl.errors.InvalidRequestError, match="iterated once"):
            _ = [g async for g in failing]
        async for _ in job.rollout(PROMPTS * 4, n=4, reward=tool_reward, params=PARAMS):
            break  # a consumer that stops early: the rest of the rollout is cancelled, not left queued
        async with asyncio.timeout(30):
            while (await job.stats()).queued:
                await asyncio.sleep(0.05)


async def _grpo_steps(job: plexrl.Job, pipelined: bool, steps: int) -> tuple[list[float], np.ndarray]:
    rewards = []
    for step in range(steps):
        prompts = [p[: 2 + step] for p in PROMPTS]
        rollout = job.rollout(prompts, n=4, reward=tool_reward, params=PARAMS, chunk=4)
        await train(job, rollout if pipelined else [g async for g in rollout], per_call=2)
        await job.sync_weights()
        rewards.append(float(np.mean([r for g in rollout.groups for r in g.rewards])))
    return rewards, (await job.logprobs(PROMPTS)).logprobs.values


@pytest.mark.asyncio
async def test_pipelined_training_learns_exactly_as_the_synchronous_baseline(tiny_model: Path) -> None:
    """The same prompts and seeds, trained after the whole rollout or group by group as groups
    complete: the same on-policy algorithm, so the same rewards and the same final weights."""
    spec = {"model": tiny_model, "lora": plexrl.LoRA(rank=4), "optimizer": plexrl.AdamW(lr=5e-2), "seed": 5}
    async with plexrl.local(workers=2):
        async with plexrl.job("sync", placement="disaggregated", **spec) as job:  # type: ignore[arg-type]
            sync_rewards, sync_lp = await _grpo_steps(job, pipelined=False, steps=3)
        async with plexrl.job("piped", placement="disaggregated", **spec) as job:  # type: ignore[arg-type]
            piped_rewards, piped_lp = await _grpo_steps(job, pipelined=True, steps=3)
    assert piped_rewards == sync_rewards
    np.testing.assert_allclose(piped_lp, sync_lp, atol=1e-6)  # gradients summed in the same order
