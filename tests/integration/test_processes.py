"""The commands as an operator runs them: `plexrl local`, `plexrl status`, and clean shutdown."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import pytest

import plexrl
from plexrl.errors import CoordinatorLostError


async def _plexrl(*args: str, stdout: int | None = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "plexrl", *args, stdout=stdout)


async def test_plexrl_local_serves_status_and_stops_on_ctrl_c() -> None:
    local = await _plexrl("local", "--workers", "1")
    assert local.stdout is not None
    async with asyncio.timeout(120):
        banner = (await local.stdout.readline()).decode()
        address = re.search(r"tcp://[0-9.]+:\d+", banner)
        assert address, banner
        keys = dict(re.findall(r"(PLEXRL_\w+)=(\S+)", (await local.stdout.readline()).decode()))
        assert keys.keys() == {"PLEXRL_KEY", "PLEXRL_COORDINATOR_KEY"}
        status = await _plexrl("status", "--coordinator", address.group(), "--key", keys["PLEXRL_KEY"],
                               "--coordinator-key", keys["PLEXRL_COORDINATOR_KEY"])  # fmt: skip
        out, _ = await status.communicate()
        assert status.returncode == 0
        assert "local-0" in out.decode()
        local.send_signal(signal.SIGINT)
        assert await local.wait() == 0


async def test_a_terminated_coordinator_fails_in_flight_calls_and_exits_cleanly(tiny_model: Path) -> None:
    cluster = plexrl.local(workers=1)
    async with cluster, plexrl.job("cut-short", model=tiny_model) as job:
        long_call = job.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=8, max_tokens=200))
        assert cluster.client is not None
        await cluster.client.status()  # answered after the call above was dispatched
        assert cluster.coordinator is not None
        cluster.coordinator.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            with pytest.raises(CoordinatorLostError, match="shut down"):
                await long_call
            assert await cluster.coordinator.wait() == 0


async def test_embedded_children_die_with_a_killed_script() -> None:
    script = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).parent / "orphan_script.py"), stdout=asyncio.subprocess.PIPE
    )
    assert script.stdout is not None
    async with asyncio.timeout(120):
        pids = [int(p) for p in (await script.stdout.readline()).split()]
        assert len(pids) == 2
        script.kill()
        await script.wait()
        for pid in pids:
            await _exited(pid)


async def test_a_child_that_ignores_the_parents_death_signal_still_exits() -> None:
    """A clean shutdown that hangs (here: SIGTERM ignored) must not leave an orphan behind."""
    child = (
        "import signal, sys, threading; from plexrl import cli; cli._die_with_parent(int(sys.argv[1])); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); threading.Event().wait()"
    )
    parent = (
        "import os, subprocess, sys; "
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())], stdout=subprocess.PIPE); "
        "assert c.stdout.readline().strip() == b'ready'; print(c.pid, flush=True); c.wait()"
    )
    script = await asyncio.create_subprocess_exec(sys.executable, "-c", parent, stdout=asyncio.subprocess.PIPE)
    assert script.stdout is not None
    async with asyncio.timeout(60):
        pid = int(await script.stdout.readline())
        script.kill()
        await script.wait()
        await _exited(pid)


async def _exited(pid: int) -> None:
    """Wait until ``pid`` (not our child) terminates, via a pidfd that turns readable then."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_reader(fd, done.set)
    try:
        await done.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_a_worker_registers_again_with_a_coordinator_restarted_after_a_crash() -> None:
    """No Shutdown notice reaches the worker (SIGKILL); the new coordinator does not know the
    worker's heartbeats, answers them with Shutdown, and the worker registers with it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    beat = ["--heartbeat-interval", "0.2", "--heartbeat-liveness", "50"]  # 10 s: liveness alone is too slow
    first = await _plexrl("coordinator", "--bind", address, "--insecure", *beat, stdout=None)
    worker = await _plexrl("worker", "--coordinator", address, "--name", "survivor", stdout=None)
    try:
        async with asyncio.timeout(60), plexrl.connect(address) as client:
            assert [w.name for w in (await client.status(min_workers=1)).workers] == ["survivor"]
        first.kill()
        await first.wait()
        second = await _plexrl("coordinator", "--bind", address, "--insecure", *beat, stdout=None)
        try:
            async with asyncio.timeout(8), plexrl.connect(address) as client:
                status = await client.status(min_workers=1)
                assert [w.name for w in status.workers] == ["survivor"]
                assert status.workers[0].pid == worker.pid
        finally:
            second.terminate()
            await second.wait()
    finally:
        worker.terminate()
        await worker.wait()
