"""Multi-turn trajectories through real processes (transformers sampler): token-exact turns,
per-token weight versions, budgets and stop reasons."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plexrl
from plexrl.errors import StaleSamplesError, TrajectoryError
from trajectory_checks import check_turns_are_token_exact

PROMPT = [1, 5, 6, 7]
OBSERVATIONS = [[3, 4, 3], [9, 9], [4]]
PARAMS = plexrl.SamplingParams(max_tokens=6, temperature=1.0)


@pytest.mark.asyncio
async def test_turns_continue_the_exact_tokens_and_train_on_sampled_tokens_only(tiny_model: Path) -> None:
    async with plexrl.local(workers=1), plexrl.job("agent", model=tiny_model) as job:
        traj = await check_turns_are_token_exact(job, PROMPT, OBSERVATIONS, atol=1e-5)
        assert all(t.cached_tokens is None for t in traj.turns)  # the hf sampler has no prefix cache
        assert plexrl.prefix_cache_hit_rate([traj]) is None
        assert [t.ok for t in traj.turns] == [True] * 3


@pytest.mark.asyncio
async def test_every_sampled_token_carries_its_weight_version(tiny_model: Path) -> None:
    async with plexrl.local(workers=1), plexrl.job("versions", model=tiny_model) as job:
        traj = job.trajectory(PROMPT)
        first = await traj.generate(PARAMS)
        traj.observe(OBSERVATIONS[0], ok=False, latency_s=0.5)
        await job.sync_weights()  # the next turn samples with version 1
        second = await traj.generate(PARAMS)
        assert first is not None and second is not None
        assert (first.weight_version, second.weight_version) == (0, 1)
        assert first.ok is False and first.latency_s == 0.5
        batch = plexrl.trajectory_batch([traj], [0.5], [0])
        assert batch.token_versions is not None and batch.weight_versions_B is not None
        expected = [0] * len(first.tokens) + [-1] * len(OBSERVATIONS[0]) + [1] * len(second.tokens)
        assert batch.token_versions[0].tolist() == expected
        assert batch.weight_versions_B.tolist() == [0]  # a row's version is its oldest token's
        with pytest.raises(StaleSamplesError, match=r"version\(s\) \[0\]"):
            await job.forward_backward(batch)  # on-policy: every sampled token must be of version 1


@pytest.mark.asyncio
async def test_budgets_end_a_trajectory_gracefully_with_their_stop_reason(tiny_model: Path) -> None:
    async with plexrl.local(workers=1), plexrl.job("budgets", model=tiny_model) as job:
        # max_tokens: every turn is cut to what is left, an observation that does not fit stops it.
        traj = job.trajectory(PROMPT, max_tokens=16)
        while await traj.generate(PARAMS) is not None:
            assert len(traj) <= 16
            if traj.stop_reason is None:
                traj.observe([3, 3])
        assert traj.stop_reason == "max_tokens" and len(traj) <= 16 and traj.turns
        batch = plexrl.trajectory_batch([traj], [1.0], [0])  # a stopped trajectory is still trained on
        assert len(batch.tokens[0]) <= 16
        # A turn that outlives its timeout is cancelled; the trajectory stops, the job carries on.
        late = job.trajectory(PROMPT, turn_timeout_s=1e-6)
        assert await late.generate(PARAMS) is None and late.stop_reason == "turn_timeout" and not late.turns
        whole = job.trajectory(PROMPT, timeout_s=1e-6)
        assert await whole.generate(PARAMS) is None and whole.stop_reason == "timeout"
        out = await job.generate([PROMPT], PARAMS)
        assert len(out.samples) == 1
        # The caller's own reason; nothing more is taken after a stop.
        done = job.trajectory(PROMPT)
        assert await done.generate(PARAMS) is not None
        done.stop("answered")
        assert await done.generate(PARAMS) is None and done.stop_reason == "answered"
        with pytest.raises(TrajectoryError, match="has stopped"):
            done.observe([3])
        # An empty trajectory trains nothing but its reward is its group's baseline.
        batch = plexrl.trajectory_batch([late, done, traj], [0.0, 1.0, 1.0], [0, 0, 0])
        assert len(batch.tokens) == 2 and batch.advantages_B is not None
        assert np.all(batch.advantages_B > 0)  # both beat the empty one's 0.0


@pytest.mark.asyncio
async def test_a_trajectory_refuses_misuse_with_what_to_fix(tiny_model: Path) -> None:
    async with plexrl.local(workers=1), plexrl.job("misuse", model=tiny_model) as job:
        traj = job.trajectory(PROMPT)
        with pytest.raises(TrajectoryError, match="follows a turn"):
            traj.observe([3])
        with pytest.raises(TrajectoryError, match="one completion per turn"):
            await traj.generate(plexrl.SamplingParams(n=2))
        with pytest.raises(TrajectoryError, match="max_tokens=4 must exceed"):
            job.trajectory(PROMPT, max_tokens=4)
        with pytest.raises(TrajectoryError, match="max_turns=0"):
            job.trajectory(PROMPT, max_turns=0)
        with pytest.raises(plexrl.errors.BatchShapeError, match="nothing to train on"):
            plexrl.trajectory_batch([traj], [1.0], [0])
