"""A coordinator SIGKILLed and started again with its journal resumes its jobs (issue 13): the
client reconnects by itself, reattaches its job and settles its unanswered calls by the job's
commit point; the workers register again and the job is rebuilt on one of them from its
journaled snapshot. The user's loop sees nothing but latency: every result, and the weights at
the end, equal those of the same loop on a cluster where nothing died."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import plexrl
from integration.same_results import assert_same_results
from plexrl.errors import CoordinatorLostError, UnknownJobError
from plexrl.protocol import calls
from plexrl.types import LoRA

INTERVAL, LIVENESS = 0.2, 5  # a coordinator silent for 1 s is noticed
PROMPTS = [[1, 5, 6, 7], [1, 9, 10]]
PROBE = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10, 11, 12, 13]]
PARAMS = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)


async def _restart(cluster: plexrl.LocalCluster) -> None:
    """SIGKILL the coordinator and start another on its address and journal."""
    assert cluster.coordinator is not None
    cluster.coordinator.kill()
    await cluster.coordinator.wait()
    await cluster.start_coordinator()


async def run(tiny_model: Path, journal: Path, kill_at: int | None) -> tuple[list[object], int]:
    """Three GRPO steps; with ``kill_at``, the coordinator is SIGKILLed and restarted right after
    that step's calls are submitted (before any of them is awaited)."""
    cluster = plexrl.local(workers=1, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS, journal=journal)
    results: list[object] = []
    async with cluster as client, plexrl.job("j", tiny_model, lora=LoRA(rank=4), seed=3) as job:
        out = await job.generate(PROMPTS, PARAMS)
        for step in range(3):
            rewards = [float(int(s.tokens.sum()) % 5) for s in out.samples]
            batch = plexrl.grpo_batch(PROMPTS, out, rewards)
            pending = [job.forward_backward(batch, loss="grpo"), job.optim_step(), job.sync_weights()]
            following = job.generate(PROMPTS, PARAMS)
            if step == kill_at:
                await client.status()  # answered once the calls above reached the coordinator
                await _restart(cluster)
            async with asyncio.timeout(180):
                results += list(await asyncio.gather(*pending))
                out = await following
            results.append(out)
        results.append(await job.logprobs(PROBE))
        recoveries = (await job.stats()).recoveries
    return results, recoveries


async def test_a_job_goes_on_across_a_coordinator_restart_as_if_nothing_happened(
    tiny_model: Path, tmp_path: Path
) -> None:
    calm, none = await run(tiny_model, tmp_path / "calm.sqlite", kill_at=None)
    faulted, once = await run(tiny_model, tmp_path / "faulted.sqlite", kill_at=1)
    assert (none, once) == (0, 1)  # rebuilt once, from the journal
    assert_same_results(calm, faulted)


async def test_without_a_journal_a_restart_fails_the_jobs_calls_with_a_typed_error(tiny_model: Path) -> None:
    cluster = plexrl.local(workers=1, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS)
    async with cluster as client:
        job_cm = plexrl.job("j", tiny_model, lora=LoRA(rank=4))
        job = await job_cm.__aenter__()
        pending = job.generate(PROMPTS, PARAMS)
        await client.status()
        await _restart(cluster)
        with pytest.raises(UnknownJobError, match="restarted without --journal"):
            async with asyncio.timeout(60):
                await pending
        with pytest.raises(UnknownJobError):  # the job is gone; the client lives on
            await job.generate(PROMPTS, PARAMS)
        assert len((await client.status(min_workers=1)).workers) == 1
        with pytest.raises((UnknownJobError, CoordinatorLostError)):
            await job_cm.__aexit__(None, None, None)


async def test_an_opening_interrupted_by_a_restart_completes_once(tiny_model: Path, tmp_path: Path) -> None:
    """The OpenJob's reply never came: the client finds the job by the opening's token if the
    opening finished before the crash, else opens it again; either way one job, usable."""
    cluster = plexrl.local(
        workers=1, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS, journal=tmp_path / "j.sqlite"
    )
    async with cluster as client:
        spec = calls.JobSpec(model=str(tiny_model), lora=LoRA(rank=4), seed=3)
        opening = asyncio.ensure_future(client.open_job("j", spec))
        await client.status()  # answered after the OpenJob reached the coordinator
        await _restart(cluster)
        async with asyncio.timeout(180):
            job_id, opened = await opening
        assert [j.job_id for j in (await client.status()).jobs] == [job_id]
        job = plexrl.Job(client, job_id, "j", spec, opened)
        out = await job.generate(PROMPTS, PARAMS)
        assert len(out.samples) == 8
        await job.close()
