"""A wedged engine is told from a slow one: a worker whose vLLM engine stops making progress
while it runs a generate (here its engine-core process is stopped with SIGSTOP; the worker itself
and its heartbeats go on) is declared hung after the coordinator's hang timeout, its calls fail with
``WorkerLostError``, and it exits with its engine process (status ``EXIT_HUNG``), so a supervisor
starts a fresh one. A call that is merely long is not: the engine's progress keeps it alive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

import plexrl
from plexrl.errors import WorkerLostError
from plexrl.models import TINY_MODEL
from plexrl.worker.sampler import vllm as vllm_sampler
from plexrl.worker.server import EXIT_HUNG

if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

HANG_S = 10.0  # past a first batch's tick-free adapter load (the engine compiled its kernels at start: _warm_up)
INTERVAL, LIVENESS = 0.25, 8  # heartbeats: a silent worker would be dead after 2 s


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


async def test_a_worker_whose_engine_stops_progressing_is_declared_hung_and_exits() -> None:
    cluster = plexrl.local(
        workers=1, sampler="vllm", start_timeout_s=600, hang_timeout_s=HANG_S,
        heartbeat_interval_s=INTERVAL, heartbeat_liveness=LIVENESS,
        snapshot_max_bytes=0,  # its job is lost with the worker (no other worker could take it over anyway)
    )  # fmt: skip
    async with cluster as client, plexrl.job("wedged", TINY_MODEL, seed=1) as job:
        (worker,) = (await client.status()).workers
        (proc,) = cluster.worker_processes
        # The job's first requests load its adapter and meet these batch shapes: no ticks meanwhile.
        await job.generate([[1, 5]], plexrl.SamplingParams(max_tokens=2))
        await job.generate([[1, 5, 6, 7]] * 32, plexrl.SamplingParams(n=8, max_tokens=4, min_tokens=4))
        # Slow but alive: this generate runs for longer than the hang timeout, making progress.
        slow = await job.generate([[1, 5, 6, 7]] * 32, plexrl.SamplingParams(n=8, max_tokens=300, min_tokens=300))
        assert len(slow.samples) == 256
        assert [w.worker_id for w in (await client.status()).workers] == [worker.worker_id]

        stuck = job.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=8, max_tokens=300, min_tokens=300))
        await client.status()  # answered after the generate was dispatched
        engines = children(worker.pid)
        assert engines, "the vLLM worker runs its engine core in a child process"
        exits = [os.pidfd_open(pid) for pid in engines]  # readable once the process has exited
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(HANG_S + 30):
                with pytest.raises(WorkerLostError, match="hung: its engine made no progress"):
                    await stuck
                assert await proc.wait() == EXIT_HUNG
                await asyncio.gather(*(exited(fd) for fd in exits))  # the worker killed its engine processes
        finally:
            for pid in engines:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            for fd in exits:
                os.close(fd)
        assert (await client.status()).workers == []


async def exited(pidfd: int) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, done.set_result, None)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
