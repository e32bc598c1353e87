"""Killing a worker fails the calls of its jobs that cannot be recovered (here: a coordinator that
keeps no snapshots) with WorkerLostError within the heartbeat timeout; jobs on other workers carry
on. (Recoverable jobs: test_worker_recovery.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import plexrl
from plexrl.errors import WorkerLostError

INTERVAL, LIVENESS = 0.2, 5  # a worker silent for 1 s is dead


async def test_a_killed_workers_calls_fail_and_other_workers_jobs_carry_on(tiny_model: Path) -> None:
    cluster = plexrl.local(workers=2, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS, snapshot_max_bytes=0)
    async with (
        cluster as client,
        plexrl.job("doomed", model=tiny_model) as doomed,
        plexrl.job("survivor", model=tiny_model) as survivor,
    ):
        status = await client.status()
        homes = {j.job_id: j.worker_id for j in status.jobs}
        assert homes[doomed.job_id] != homes[survivor.job_id]
        (victim,) = [w for w in status.workers if w.worker_id == homes[doomed.job_id]]

        long_call = doomed.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=8, max_tokens=200))
        queued = doomed.sync_weights()
        await client.status()  # answered after the call above was dispatched
        (proc,) = [p for p in cluster.worker_processes if p.pid == victim.pid]
        proc.kill()

        async with asyncio.timeout(INTERVAL * LIVENESS + 10):
            with pytest.raises(WorkerLostError, match="lost"):
                await long_call
            with pytest.raises(WorkerLostError):
                await queued
        with pytest.raises(WorkerLostError):
            await doomed.sync_weights()
        out = await survivor.generate([[1, 2]], plexrl.SamplingParams(max_tokens=3))
        assert len(out.samples) == 1
        assert [w.worker_id for w in (await client.status()).workers] == [homes[survivor.job_id]]
