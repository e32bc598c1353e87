"""One check that both samplers' tests run: a trajectory's turns are token-exact (imported by
tests/integration/test_trajectory.py and tests/vllm/test_vllm_sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import plexrl


async def check_turns_are_token_exact(
    job: plexrl.Job, prompt: Sequence[int], observations: Sequence[Sequence[int]], atol: float
) -> plexrl.Trajectory:
    """Three turns with an observation after each; the batch row is exactly prompt, turns and the
    observations between them; the trainer, at the sampler's weights, scores every sampled token
    of it as the sampler did (it saw the same context); the loss covers sampled tokens only."""
    traj = job.trajectory(prompt, max_turns=3)
    params = plexrl.SamplingParams(max_tokens=6, temperature=1.0)
    prompts_seen = []
    while (turn := await traj.generate(params)) is not None:
        prompts_seen.append(turn.prompt_tokens)
        traj.observe(observations[len(traj.turns) - 1], ok=True, latency_s=0.01)
    assert traj.stop_reason == "max_turns" and len(traj.turns) == 3
    t0, t1, t2 = traj.turns
    # Each turn continued the whole sequence before it.
    assert prompts_seen == [len(prompt), len(prompt) + len(t0.tokens) + len(t0.observation),
                            len(prompt) + sum(len(t.tokens) + len(t.observation) for t in (t0, t1))]  # fmt: skip
    batch = plexrl.trajectory_batch([traj], [1.0], [0])
    row = np.concatenate([prompt, t0.tokens, observations[0], t1.tokens, observations[1], t2.tokens])
    np.testing.assert_array_equal(batch.tokens[0], row)  # the last observation trains nothing: left out
    mask = batch.loss_mask[0] if batch.loss_mask is not None else None
    versions = batch.token_versions[0] if batch.token_versions is not None else None
    assert mask is not None and versions is not None
    sampled = np.concatenate([np.ones(len(t0.tokens)), np.zeros(len(observations[0])), np.ones(len(t1.tokens)),
                              np.zeros(len(observations[1])), np.ones(len(t2.tokens))]).astype(bool)  # fmt: skip
    np.testing.assert_array_equal(mask.astype(bool), sampled)
    assert set(versions[sampled].tolist()) == {t0.weight_version} and set(versions[~sampled].tolist()) <= {-1}
    trainer = (await job.logprobs([row])).logprobs[0][len(prompt) - 1 :]
    assert batch.sampler_logprobs is not None
    np.testing.assert_allclose(trainer[sampled], batch.sampler_logprobs[0][sampled], atol=atol)
    fb = await job.forward_backward(batch)
    assert fb.num_tokens == traj.sampled_tokens == int(sampled.sum())
    return traj
