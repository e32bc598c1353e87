"""Client leases over real processes: a SIGKILLed client's job is suspended, reattached by the
same key with its state as it was, or closed once its grace period runs out."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import plexrl
from plexrl.errors import UnknownJobError

HERE = Path(__file__).parent


async def _lease_client(cluster: plexrl.LocalCluster, model: Path) -> tuple[asyncio.subprocess.Process, str]:
    """Run lease_client.py until its job exists at version 1: the process and its job id."""
    assert cluster.client is not None
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "lease_client.py"), cluster.client.address, str(model),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**os.environ, **cluster.client_env()},
    )  # fmt: skip
    assert proc.stdout is not None
    job_id, version = (await proc.stdout.readline()).decode().split()
    assert version == "1"
    return proc, job_id


async def _killed_client(cluster: plexrl.LocalCluster, model: Path) -> str:
    """A lease_client.py SIGKILLed once its job exists at version 1; its job id."""
    proc, job_id = await _lease_client(cluster, model)
    proc.kill()
    await proc.wait()
    return job_id


async def test_a_killed_clients_job_is_suspended_then_reattached_as_it_was(tiny_model: Path) -> None:
    cluster = plexrl.local(workers=1, heartbeat_interval_s=0.2, client_timeout_s=1.0)
    async with asyncio.timeout(120), cluster as client:
        job_id = await _killed_client(cluster, tiny_model)
        job = await client.reattach("leased")  # answered once the killed client is declared gone
        assert job.job_id == job_id
        (info,) = (await client.status()).jobs
        assert (info.job_id, info.state) == (job_id, "open")
        assert (await job.sync_weights()).weight_version == 2  # the same job: its version went on
        await job.close()
        assert (await client.status()).jobs == []


async def test_a_killed_clients_job_is_closed_after_its_grace_period(tiny_model: Path) -> None:
    cluster = plexrl.local(workers=1, heartbeat_interval_s=0.2, client_timeout_s=1.0, client_grace_s=0.0)
    async with asyncio.timeout(120), cluster as client:
        await _killed_client(cluster, tiny_model)
        with pytest.raises(UnknownJobError, match="closed"):
            await client.reattach("leased")
        assert [j.state for j in (await client.status()).jobs] in ([], ["closing"])
        with pytest.raises(UnknownJobError, match="no job named"):
            await client.reattach("never-opened")


async def test_a_client_that_stalled_past_its_lease_takes_its_job_back_by_itself(tiny_model: Path) -> None:
    """Stopped (SIGSTOP) until the coordinator suspends its job, then continued: the client hears
    that the coordinator no longer knows it, says Hello again, reattaches its job and goes on."""
    cluster = plexrl.local(workers=1, heartbeat_interval_s=0.2, client_timeout_s=1.0)
    async with asyncio.timeout(120), cluster as client:
        proc, job_id = await _lease_client(cluster, tiny_model)
        assert proc.stdin is not None and proc.stdout is not None
        proc.send_signal(signal.SIGSTOP)
        while [j.state for j in (await client.status()).jobs] != ["suspended"]:
            pass  # each status is a round trip to the coordinator
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write(b"sync\n")
        await proc.stdin.drain()
        assert (await proc.stdout.readline()).decode().split() == [job_id, "2"]  # the same job went on
        (info,) = (await client.status()).jobs
        assert info.state == "open"
        proc.stdin.close()
        assert await proc.wait() == 0
        assert (await client.status()).jobs == []  # its script closed it on the way out
