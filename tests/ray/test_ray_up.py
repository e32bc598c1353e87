"""plexrl on a Ray cluster: `plexrl up --ray` runs jobs; a killed worker comes back through Ray.

A local Ray cluster (a head node of 3 CPUs: the coordinator's and two workers') is started for the
module and stopped with every process it started (its own process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

import plexrl
from plexrl.models import TINY_MODEL
from plexrl.protocol.messages import WorkerInfo

if os.environ.get("PLEXRL_REQUIRE_VLLM"):  # CI: everything installed, nothing skipped
    import ray  # noqa: F401
else:
    pytest.importorskip("ray", reason="plexrl on Ray needs Ray: pip install 'plexrl[ray]'")

from plexrl import ray as plexrl_ray

pytestmark = pytest.mark.asyncio(loop_scope="module")

RAY = Path(sys.executable).with_name("ray")
PROMPTS = [[1, 5, 6, 7], [1, 9, 9]]
SAMPLING = plexrl.SamplingParams(n=4, max_tokens=6, temperature=1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(FileNotFoundError):  # a zombie has exited too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    return True


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster in a process group of its own; its temp dir short (socket paths)."""
    temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    port = _free_port()
    log = (temp / "head.log").open("w")
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", "--port", str(port), "--num-cpus", "3", "--temp-dir", str(temp),
         "--disable-usage-stats", "--include-dashboard=false", "--object-store-memory", str(100 << 20),
         "--dashboard-port", str(_free_port()), "--ray-client-server-port", str(_free_port())],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_until(
            lambda: head.poll() is not None or "will now block" in (temp / "head.log").read_text(),
            120,
            "the Ray head to start",
        )
        assert head.poll() is None, (temp / "head.log").read_text()[-3000:]
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            log.close()
            shutil.rmtree(temp, ignore_errors=True)


async def _grpo_step(job: plexrl.Job) -> tuple[plexrl.Optimized, plexrl.Synced]:
    out = await job.generate(PROMPTS, SAMPLING)
    rewards_B = (np.diff(out.tokens.offsets) % 2).astype(np.float32)
    rewards_B[::4] = 1.0 - rewards_B[::4]  # every group holds different rewards: nonzero advantages
    optimized = await job.optimize(plexrl.grpo_batch(PROMPTS, out, rewards_B), loss="grpo")
    return optimized, await job.sync_weights()


async def _line(stream: asyncio.StreamReader, pattern: str) -> re.Match[str]:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise AssertionError(f"the stream ended before a line matching {pattern!r}")
        if match := re.search(pattern, line):
            return match


async def test_without_ray_installed_up_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    with pytest.raises(plexrl.errors.InvalidRequestError, match=re.escape("pip install 'plexrl[ray]'")):
        plexrl_ray.up("127.0.0.1:6379")


async def test_an_unreachable_ray_address_fails_fast_with_what_to_do() -> None:
    with pytest.raises(plexrl_ray.RayClusterError, match="ray start --head"):
        await asyncio.to_thread(plexrl_ray.up, f"127.0.0.1:{_free_port()}")


async def test_plexrl_up_brings_workers_up_on_ray_and_a_grpo_step_runs_on_them(ray_address: str) -> None:
    up = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plexrl", "up", "--ray", ray_address, "--devices", "2", "--sampler", "hf",
        "--start-timeout", "150", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert up.stdout is not None
    try:
        async with asyncio.timeout(180):
            address = (await _line(up.stdout, r"coordinator (tcp://\S+);")).group(1)
            env = await _line(up.stdout, r"PLEXRL_KEY=(\S+) PLEXRL_COORDINATOR_KEY=(\S+)")
        credentials = plexrl.Credentials.load(env.group(1), env.group(2))
        async with plexrl.connect(address, credentials=credentials) as client:
            status = await client.status()
            assert sorted(w.name for w in status.workers) == ["ray-0", "ray-1"]
            async with plexrl.job("ray-grpo", model=TINY_MODEL, optimizer=plexrl.AdamW(lr=1e-3)) as job:
                optimized, synced = await _grpo_step(job)
        assert optimized.step == 1 and np.isfinite(optimized.loss)
        assert synced.weight_version == 1
        pids = [w.pid for w in status.workers]
        up.send_signal(signal.SIGINT)
        async with asyncio.timeout(90):
            assert await up.wait() == 0
        _wait_until(lambda: all(_gone(pid) for pid in pids), 30, "the workers to stop with `plexrl up`")
    finally:
        if up.returncode is None:  # a failure above: let it tear down what it started on the cluster
            up.send_signal(signal.SIGINT)
            try:
                async with asyncio.timeout(90):
                    await up.wait()
            finally:
                if up.returncode is None:
                    up.kill()
                    await up.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def on_ray(ray_address: str) -> AsyncIterator[plexrl_ray.RayCluster]:
    cluster = await asyncio.to_thread(plexrl_ray.up, ray_address, devices=1, sampler="hf", start_timeout_s=150)
    async with cluster:
        yield cluster


async def test_a_killed_worker_is_restarted_by_ray_and_its_job_runs_again(on_ray: plexrl_ray.RayCluster) -> None:
    async with on_ray.connect() as client:
        async with plexrl.job("survivor", model=TINY_MODEL, optimizer=plexrl.AdamW(lr=1e-3)) as job:
            await _grpo_step(job)
            (killed,) = (await client.status()).workers
            os.kill(killed.pid, signal.SIGKILL)

            async def replaced() -> WorkerInfo:
                while True:  # the coordinator drops the dead worker (heartbeats) and Ray's new one registers
                    workers = (await client.status()).workers
                    if len(workers) == 1 and workers[0].worker_id != killed.worker_id:
                        return workers[0]
                    await asyncio.sleep(0.5)

            async with asyncio.timeout(120):
                new = await replaced()
            assert new.name == killed.name and new.pid != killed.pid
            optimized, synced = await _grpo_step(job)
        assert optimized.step >= 1 and synced.weight_version >= 1


async def test_asking_for_more_devices_than_the_cluster_has_says_so(on_ray: plexrl_ray.RayCluster) -> None:
    with pytest.raises(plexrl.errors.InvalidRequestError, match="room for 2 worker"):
        await asyncio.to_thread(plexrl_ray.up, on_ray.ray_address, devices=3)
