"""Disaggregated placement through real processes: a job trains on one worker and samples on
another (a replica of its sampler, fed new weights on every sync), exactly as it does colocated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import plexrl

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 3]]
SAMPLING = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)
GREEDY = plexrl.SamplingParams(max_tokens=6, temperature=0.0)


@pytest.mark.asyncio
async def test_a_disaggregated_job_learns_exactly_as_a_colocated_one(tiny_model: Path, tmp_path: Path) -> None:
    spec = {"model": tiny_model, "lora": plexrl.LoRA(rank=4), "optimizer": plexrl.AdamW(lr=5e-2), "seed": 3}
    async with plexrl.local(workers=2, checkpoint_root=tmp_path) as client:
        async with plexrl.job("apart", placement="disaggregated", **spec) as apart:  # type: ignore[arg-type]
            status = await client.status()
            (info,) = [j for j in status.jobs if j.job_id == apart.job_id]
            assert info.sampler_worker_id and info.sampler_worker_id != info.worker_id
            out = await apart.generate(PROMPTS, SAMPLING)
            assert out.weight_version == 0
            batch = plexrl.grpo_batch(PROMPTS, out, [float(len(s.tokens)) for s in out.samples])
            await apart.optimize(batch, loss="grpo")
            assert (await apart.sync_weights()).weight_version == 1
            after = await apart.generate(PROMPTS, SAMPLING)  # on the replica, with the pushed weights
            assert after.weight_version == 1
            # A checkpoint loaded on the home worker reaches the replica too.
            saved = await apart.generate(PROMPTS, GREEDY)
            await apart.save("v1")
            more = await apart.generate(PROMPTS, SAMPLING)
            await apart.optimize(plexrl.grpo_batch(PROMPTS, more, [1.0, 0.0, 0.0, 1.0] * 3), loss="grpo")
            assert (await apart.sync_weights()).weight_version == 2
            assert (await apart.load("v1")).weight_version == 1
            again = await apart.generate(PROMPTS, GREEDY)
            assert again.weight_version == 1 and again.tokens.values.tolist() == saved.tokens.values.tolist()
            np.testing.assert_array_equal(again.logprobs.values, saved.logprobs.values)
            apart_lp = (await apart.logprobs(PROMPTS)).logprobs.values
        async with plexrl.job("together", **spec) as together:  # type: ignore[arg-type]
            out2 = await together.generate(PROMPTS, SAMPLING)
            batch2 = plexrl.grpo_batch(PROMPTS, out2, [float(len(s.tokens)) for s in out2.samples])
            await together.optimize(batch2, loss="grpo")
            await together.sync_weights()
            after2 = await together.generate(PROMPTS, SAMPLING)
            together_lp = (await together.logprobs(PROMPTS)).logprobs.values
    assert [s.tokens.tolist() for s in out.samples] == [s.tokens.tolist() for s in out2.samples]
    assert [s.tokens.tolist() for s in after.samples] == [s.tokens.tolist() for s in after2.samples]
    np.testing.assert_array_equal(apart_lp, together_lp)


@pytest.mark.asyncio
async def test_training_runs_while_the_jobs_sampler_worker_generates(tiny_model: Path) -> None:
    """A long generate on the sampler worker does not hold back forward_backward on the home."""
    async with plexrl.local(workers=2), plexrl.job("overlap", model=tiny_model, placement="disaggregated") as job:
        out = await job.generate(PROMPTS, SAMPLING)
        batch = plexrl.grpo_batch(PROMPTS, out, [1.0, 0.0, 0.0, 0.0] * 3)
        long = job.generate(PROMPTS * 8, plexrl.SamplingParams(n=16, max_tokens=64, temperature=1.0))
        trained = job.forward_backward(batch)
        done, _ = await asyncio.wait([long, trained], return_when=asyncio.FIRST_COMPLETED)
        assert trained in done and not long.done()  # training finished while sampling went on
        await long


@pytest.mark.asyncio
async def test_full_weights_go_worker_to_worker_not_through_the_coordinator(tiny_model: Path) -> None:
    """With messages capped below the model's size (2.4 MB), a full fine-tune's sync reaches its
    sampler worker over the workers' data plane; sent through the coordinator (the old path,
    ``weights_via="coordinator"``) the same sync fails with a typed error, and the job goes on."""
    for via in ("workers", "coordinator"):
        cluster = plexrl.local(workers=2, max_message_bytes=1 << 20, snapshot_max_bytes=0, weights_via=via)
        async with cluster, plexrl.job("full", tiny_model, lora=None, placement="disaggregated", seed=1) as job:
            out = await job.generate(PROMPTS, SAMPLING)
            await job.optimize(plexrl.grpo_batch(PROMPTS, out, [float(len(s.tokens)) for s in out.samples]))
            if via == "workers":
                synced = await job.sync_weights()
                assert synced.weight_version == 1 and synced.tensors is None and synced.source is None
                assert synced.push_s > 0  # the sampler worker timed the fetch
                assert (await job.generate(PROMPTS, SAMPLING)).weight_version == 1
            else:
                with pytest.raises(plexrl.errors.MessageTooLargeError, match="limit"):
                    await job.sync_weights()
                assert (await job.generate(PROMPTS, SAMPLING)).weight_version == 0
