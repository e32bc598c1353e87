"""A wedged engine is told from a slow one: a worker whose vLLM engine stops making progress
while it runs a generate (here an engine step that blocks while a flag file exists, planted in
the worker process through ``sitecustomize``: on CPU the engine runs in the worker, and the
worker itself and its heartbeats go on) is declared hung after the coordinator's hang timeout,
its calls fail with ``WorkerLostError``, and it exits (status ``EXIT_HUNG``), so a supervisor
starts a fresh one. A call that is merely long is not: the engine's progress keeps it alive."""

from __future__ import annotations

import asyncio
import os
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


# Loaded by every Python process of the test's cluster (PYTHONPATH): in the worker, each vLLM engine
# step waits while $PLEXRL_TEST_WEDGE exists, as a wedged kernel would (a hang, not a wait for an event).
WEDGE = """
import os, time
if os.environ.get("PLEXRL_TEST_WEDGE"):
    from plexrl.worker.sampler import inproc

    init = inproc.InProcessEngine.__init__

    def wedged_init(self, engine, progress):
        step = engine.step

        def wedged_step():
            while os.path.exists(os.environ["PLEXRL_TEST_WEDGE"]):
                time.sleep(0.05)
            return step()

        engine.step = wedged_step
        init(self, engine, progress)

    inproc.InProcessEngine.__init__ = wedged_init
"""


async def test_a_worker_whose_engine_stops_progressing_is_declared_hung_and_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sitecustomize.py").write_text(WEDGE)
    flag = tmp_path / "wedged"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PLEXRL_TEST_WEDGE", str(flag))
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

        flag.touch()  # from the next step on, the engine makes no progress
        stuck = job.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=8, max_tokens=300, min_tokens=300))
        try:
            async with asyncio.timeout(HANG_S + 30):
                with pytest.raises(WorkerLostError, match="hung: its engine made no progress"):
                    await stuck
                assert await proc.wait() == EXIT_HUNG
        finally:
            flag.unlink()
        assert (await client.status()).workers == []
