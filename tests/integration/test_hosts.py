"""Several hosts (network namespaces on one machine, client/hosts.py): the coordinator on one, a
worker on each of two others, all traffic over their own addresses with keys. A GRPO job's calls
run there; a disaggregated job's weights go from host to host without the coordinator; a host cut
off the network loses its worker, whose job goes on on the other, and the worker comes back when
its link does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

import plexrl
from plexrl.client import hosts
from plexrl.types import LoRA

pytestmark = pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))

INTERVAL, LIVENESS = 0.2, 10  # a worker silent for 2 s is lost
PROMPTS = [[1, 5, 6, 7], [1, 9, 10]]
PARAMS = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)


@pytest.fixture
def network() -> Iterator[hosts.Network]:
    with hosts.Network(3) as net:
        yield net


async def grpo_step(job: plexrl.Job) -> int:
    out = await job.generate(PROMPTS, PARAMS)
    rewards = [float(int(s.tokens.sum()) % 5) for s in out.samples]
    await job.optimize(plexrl.grpo_batch(PROMPTS, out, rewards), loss="grpo")
    return (await job.sync_weights()).weight_version


async def test_jobs_run_on_workers_on_other_hosts(tiny_model: Path, network: hosts.Network) -> None:
    # Messages below the model's size: a full model's weights cannot pass through the coordinator.
    cluster = plexrl.local(workers=2, hosts=network.hosts, max_message_bytes=1 << 20, snapshot_max_bytes=0)
    assert cluster.address == ""
    async with (
        cluster as client,
        plexrl.job("grpo", tiny_model, lora=LoRA(rank=4), seed=1) as job,
        plexrl.job("apart", tiny_model, lora=None, placement="disaggregated", seed=2) as apart,
    ):
        assert cluster.address.startswith(f"tcp://{network.hosts[0].address}:")
        status = await client.status()
        assert len(status.workers) == 2
        (info,) = [j for j in status.jobs if j.job_id == apart.job_id]
        assert info.sampler_worker_id and info.sampler_worker_id != info.worker_id
        assert [await grpo_step(job) for _ in range(2)] == [1, 2]
        # The full model (2.4 MB, over the 1 MiB message limit) goes from the home worker's host
        # to the sampler worker's, fetched over the data plane with the workers' keys.
        assert [await grpo_step(apart) for _ in range(2)] == [1, 2]
        assert (await apart.generate(PROMPTS, PARAMS)).weight_version == 2


async def test_a_host_cut_off_loses_its_worker_and_its_job_goes_on(tiny_model: Path, network: hosts.Network) -> None:
    cluster = plexrl.local(workers=2, hosts=network.hosts, heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS)
    async with cluster as client, plexrl.job("j", tiny_model, lora=LoRA(rank=4), seed=3) as job:
        assert await grpo_step(job) == 1
        status = await client.status()
        home = next(j.worker_id for j in status.jobs if j.job_id == job.job_id)
        pid = next(w.pid for w in status.workers if w.worker_id == home)
        (index,) = [i for i, p in enumerate(cluster.worker_processes) if p.pid == pid]
        cut = cluster.host_of(index)
        assert cut is not None
        cut.link(False)
        async with asyncio.timeout(120):
            assert await grpo_step(job) == 2  # rebuilt on the other host from its last snapshot
            assert (await job.stats()).recoveries == 1
            now = await client.status()
            assert [w.worker_id for w in now.workers] != [home] and len(now.workers) == 1
            assert home not in {w.worker_id for w in now.workers}
        cut.link(True)
        async with asyncio.timeout(120):  # the worker notices it lost the coordinator and registers again
            back = await client.status(min_workers=2)
        assert home not in {w.worker_id for w in back.workers}
        (process,) = [p for p in cluster.worker_processes if p.pid == pid]
        assert process.returncode is None  # the same process, registered anew
        async with asyncio.timeout(120):
            assert await grpo_step(job) == 3
