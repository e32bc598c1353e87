"""Jobs on a gang of two workers (``plexrl.job(..., devices=2)``) through the coordinator: they
train as on one worker, and a full fine-tune too large for one worker's budget trains on two."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

import plexrl
from plexrl.client.connection import Client
from plexrl.errors import JobTooLargeError

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 3]]
# Each worker's budget for jobs' state: a full fine-tune of the tiny model takes 12 MB alone (float32
# masters, gradients and two moments, 16 bytes a parameter, and the hf sampler's 4-byte copy), and
# 7.2 MB a member on a gang of two; a LoRA job, well under 1 MB.
BUDGET = 10 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded() -> AsyncIterator[plexrl.LocalCluster]:
    local = plexrl.local(workers=2, heartbeat_interval_s=0.5)
    async with local:
        yield local


def batches(steps: int, seed: int = 0) -> list[plexrl.Batch]:
    """GRPO batches of 6 rows of mixed lengths (one of advantage 0) with sampler logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(4, 14, size=6)
        out.append(
            plexrl.Batch(
                tokens=plexrl.Ragged.from_rows([rng.integers(3, 60, size=int(n)).tolist() for n in lengths], "int32"),
                prompt_lens_B=np.full(6, 3, np.int32),
                sampler_logprobs=plexrl.Ragged.from_rows(
                    [(-rng.random(int(n) - 3) - 0.5).tolist() for n in lengths], "float32"
                ),
                advantages_B=np.array([1.0, -0.5, 0.0, 0.7, -1.2, 0.3], np.float32),
            )
        )
    return out


async def train(job: plexrl.Job, steps: list[plexrl.Batch]) -> tuple[list[float], np.ndarray]:
    losses = [(await job.optimize(b)).loss for b in steps]
    return losses, (await job.logprobs(PROMPTS)).logprobs.values


@pytest.mark.parametrize("lora", [plexrl.LoRA(rank=4), None], ids=["lora", "full"])
async def test_a_job_on_two_workers_trains_as_on_one(
    cluster: Client, tiny_model: Path, lora: plexrl.LoRA | None
) -> None:
    steps = batches(3)
    adam = plexrl.AdamW(lr=1e-2)
    async with (
        plexrl.job("gang", model=tiny_model, lora=lora, optimizer=adam, seed=5, devices=2) as gang,
        plexrl.job("alone", model=tiny_model, lora=lora, optimizer=adam, seed=5) as alone,
    ):
        status = await cluster.status()
        members = {j.name: j.members for j in status.jobs}
        assert len(members["gang"]) == 2 and len(members["alone"]) <= 1
        (gang_losses, gang_lp), (alone_losses, alone_lp) = await asyncio.gather(train(gang, steps), train(alone, steps))
        np.testing.assert_allclose(gang_losses, alone_losses, rtol=1e-5)
        # After 3 AdamW steps at lr 1e-2 the full fine-tune's logprobs differed by up to 1.3e-4: AdamW steps
        # on rounding noise where a gradient is ~0, whose sign follows the order of the sums.
        np.testing.assert_allclose(gang_lp, alone_lp, atol=2e-3)
        assert gang_losses[0] != gang_losses[-1]
        await gang.sync_weights()
        sampled = await gang.generate(PROMPTS, plexrl.SamplingParams(max_tokens=4, temperature=0.0))
        assert len(sampled.samples) == len(PROMPTS)


async def test_a_full_fine_tune_too_large_for_one_worker_trains_on_two(tiny_model: Path) -> None:
    adam = plexrl.AdamW(lr=1e-3)
    target = plexrl.Batch(
        tokens=plexrl.Ragged.from_rows([[1, 5, 6, 7, 8, 9]] * 4, "int32"), prompt_lens_B=np.full(4, 2, np.int32)
    )
    async with plexrl.local(workers=2, heartbeat_interval_s=0.5, memory_budget_bytes=BUDGET):
        with pytest.raises(JobTooLargeError, match="devices=2"):
            async with plexrl.job("big", model=tiny_model, lora=None, optimizer=adam):
                pass
        async with plexrl.job("big", model=tiny_model, lora=None, optimizer=adam, devices=2) as big:
            losses = [(await big.optimize(target, loss="cross_entropy")).loss for _ in range(6)]
    assert losses[-1] < 0.9 * losses[0]


async def run_killing(tiny_model: Path, kill: bool) -> tuple[list[float], np.ndarray, int]:
    """Three steps of a LoRA job on a gang of two; with ``kill``, a member is SIGKILLed right after
    the second step's calls are submitted, and a replacement worker started (the job waits for a
    block of two, then is rebuilt on it from its snapshot and runs the step again)."""
    cluster = plexrl.local(workers=2, heartbeat_interval_s=0.2, heartbeat_liveness=5)
    losses = []
    async with cluster as client, plexrl.job("g", tiny_model, lora=plexrl.LoRA(rank=4), seed=3, devices=2) as job:
        for step, batch in enumerate(batches(3)):
            pending = asyncio.gather(job.forward_backward(batch), job.optim_step())
            if kill and step == 1:
                workers = (await client.status()).workers  # answered once the calls above are dispatched
                victim = next(w for w in workers if w.name == "local-1")
                (proc,) = [p for p in cluster.worker_processes if p.pid == victim.pid]
                proc.kill()
                await proc.wait()
                await cluster.start_worker(1)
            async with asyncio.timeout(120):
                done, _ = await pending
            losses.append(done.loss)
        probe = (await job.logprobs(PROMPTS)).logprobs.values
        recoveries = (await job.stats()).recoveries
    return losses, probe, recoveries


async def test_a_gang_job_whose_member_is_killed_goes_on_as_if_nothing_happened(tiny_model: Path) -> None:
    calm_losses, calm_probe, none = await run_killing(tiny_model, kill=False)
    losses, probe, once = await run_killing(tiny_model, kill=True)
    assert (none, once) == (0, 1)
    np.testing.assert_allclose(losses, calm_losses, rtol=1e-6)
    np.testing.assert_allclose(probe, calm_probe, atol=1e-6)


async def test_two_gangs_too_large_to_stay_together_take_turns_moving_their_shards(tiny_model: Path) -> None:
    """Two full fine-tunes on the same gang of two, each 7.2 MB a member under a 10 MB budget:
    each call of one moves the other's shards out of device memory on both members and its own in."""
    target = plexrl.Batch(
        tokens=plexrl.Ragged.from_rows([[1, 5, 6, 7, 8, 9]] * 4, "int32"), prompt_lens_B=np.full(4, 2, np.int32)
    )
    adam = plexrl.AdamW(lr=1e-3)

    async def train(job: plexrl.Job) -> list[float]:
        return [(await job.optimize(target, loss="cross_entropy")).loss for _ in range(4)]

    async with (
        plexrl.local(workers=2, heartbeat_interval_s=0.5, memory_budget_bytes=BUDGET, policy="plex"),
        plexrl.job("a", model=tiny_model, lora=None, optimizer=adam, seed=1, devices=2) as a,
        plexrl.job("b", model=tiny_model, lora=None, optimizer=adam, seed=1, devices=2) as b,
    ):
        losses_a, losses_b = await asyncio.gather(train(a), train(b))
        stats = [await a.stats(), await b.stats()]
    assert losses_a == losses_b  # the same job twice: moving a job's shards changes nothing
    assert losses_a[-1] < losses_a[0]
    assert sum(s.swaps for s in stats) > 0
