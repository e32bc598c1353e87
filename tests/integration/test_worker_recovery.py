"""A job whose worker dies goes on (issue 13): the coordinator keeps the snapshot of the job's
last optim_step and its calls since; when the worker is SIGKILLed, the job is rebuilt on the other
worker, its calls in flight run again there, and the user's loop sees nothing but latency: every
result, and the weights at the end, equal those of the same loop on a cluster where nothing died."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import plexrl
from integration.same_results import assert_same_results
from plexrl.types import LoRA

INTERVAL, LIVENESS = 0.2, 5  # a worker silent for 1 s is dead
PROMPTS = [[1, 5, 6, 7], [1, 9, 10]]
PROBE = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10, 11, 12, 13]]
PARAMS = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)


async def run(tiny_model: Path, kill_at: int | None) -> tuple[list[object], int]:
    """Three GRPO steps; with ``kill_at``, the job's home worker is SIGKILLed right after that
    step's calls are submitted (before any of them is awaited). Returns every result and the
    job's recoveries."""
    cluster = plexrl.local(workers=2, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS)
    results: list[object] = []
    async with cluster as client, plexrl.job("j", tiny_model, lora=LoRA(rank=4), seed=3) as job:
        out = await job.generate(PROMPTS, PARAMS)
        for step in range(3):
            rewards = [float(int(s.tokens.sum()) % 5) for s in out.samples]
            batch = plexrl.grpo_batch(PROMPTS, out, rewards)
            pending = [job.forward_backward(batch, loss="grpo"), job.optim_step(), job.sync_weights()]
            following = job.generate(PROMPTS, PARAMS)
            if step == kill_at:
                await client.status()  # answered once the calls above are dispatched
                home = next(j.worker_id for j in (await client.status()).jobs if j.job_id == job.job_id)
                pid = next(w.pid for w in (await client.status()).workers if w.worker_id == home)
                (proc,) = [p for p in cluster.worker_processes if p.pid == pid]
                proc.kill()
            async with asyncio.timeout(60):
                results += list(await asyncio.gather(*pending))
                out = await following
            results.append(out)
        results.append(await job.logprobs(PROBE))
        recoveries = (await job.stats()).recoveries
    return results, recoveries


async def test_a_job_whose_worker_is_killed_goes_on_as_if_nothing_happened(tiny_model: Path) -> None:
    calm, none = await run(tiny_model, kill_at=None)
    faulted, once = await run(tiny_model, kill_at=1)
    assert (none, once) == (0, 1)
    assert_same_results(calm, faulted)


async def test_a_job_that_waits_for_a_worker_closes_at_once(tiny_model: Path) -> None:
    """Its only worker died and none can take it over: closing it frees nothing, so it does not
    wait for one (the recovery wait is 300 s)."""
    cluster = plexrl.local(workers=1, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS)
    async with cluster as client:
        for close_early in (True, False):  # before the worker is declared lost, and after
            async with plexrl.job("orphan", tiny_model, lora=LoRA(rank=4)) as job:
                await job.generate(PROMPTS, PARAMS)
                (proc,) = [p for p in cluster.worker_processes if p.returncode is None]
                proc.kill()
                await proc.wait()
                if not close_early:
                    with pytest.raises(TimeoutError):  # it waits for a worker (and would for 300 s)
                        async with asyncio.timeout(3):
                            await job.generate(PROMPTS, PARAMS)
                async with asyncio.timeout(30):
                    await job.close()
            assert [j.name for j in (await client.status()).jobs] == []
            await cluster.start_worker(0)
            await client.status(min_workers=1)
