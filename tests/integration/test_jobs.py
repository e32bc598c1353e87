"""Several jobs from several client processes on one embedded cluster (real processes, TCP)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from safetensors.numpy import load_file

import plexrl
from plexrl.client.connection import Client
from plexrl.errors import CheckpointPathError

pytestmark = pytest.mark.asyncio(loop_scope="module")

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 3]]
GREEDY = plexrl.SamplingParams(max_tokens=6, temperature=0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[plexrl.LocalCluster]:
    local = plexrl.local(workers=1, heartbeat_interval_s=0.5, checkpoint_root=tmp_path_factory.mktemp("checkpoints"))
    async with local:
        yield local


async def test_client_processes_pipelining_calls_see_them_executed_in_order(
    cluster: Client, embedded: plexrl.LocalCluster, tiny_model: Path
) -> None:
    rounds = 6
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / "ordering_client.py"),
            cluster.address,
            str(tiny_model),
            f"order{i}",
            str(rounds),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **embedded.client_env()},
        )
        for i in range(3)
    ]
    async with asyncio.timeout(240):
        outputs = [await p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    expected = [v for r in range(rounds) for v in (r, r + 1)]  # generate sees r syncs; sync r makes r + 1
    for stdout, _ in outputs:
        assert [int(x) for x in stdout.decode().strip()[1:-1].split(",")] == expected


async def test_training_one_lora_job_never_changes_another(
    cluster: Client, embedded: plexrl.LocalCluster, tiny_model: Path
) -> None:
    async with (
        plexrl.job("trained", model=tiny_model, optimizer=plexrl.AdamW(lr=5e-2), seed=1) as a,
        plexrl.job("bystander", model=tiny_model, seed=2) as b,
        plexrl.job("full", model=tiny_model, lora=None, optimizer=plexrl.AdamW(lr=1e-3), seed=3) as c,
    ):
        b_before = await b.generate(PROMPTS, GREEDY)
        b_lp_before = await b.logprobs(PROMPTS)
        saved = await b.save("isolation/b0")
        assert embedded.checkpoint_root is not None
        assert Path(saved.path) == (Path(embedded.checkpoint_root) / "local" / "isolation" / "b0").resolve()
        a_before = await a.logprobs(PROMPTS)

        target = plexrl.Batch(
            tokens=plexrl.Ragged.from_rows([[1, 5, 6, 7, 8, 9]] * 4, "int32"), prompt_lens_B=np.full(4, 2, np.int32)
        )
        for _ in range(3):
            await asyncio.gather(a.optimize(target, loss="cross_entropy"), c.optimize(target, loss="cross_entropy"))
        await asyncio.gather(a.sync_weights(), c.sync_weights())

        b_after = await b.generate(PROMPTS, GREEDY)
        b_lp_after = await b.logprobs(PROMPTS)
        await b.save("isolation/b1")
        a_after = await a.logprobs(PROMPTS)

    assert not np.allclose(a_before.logprobs.values, a_after.logprobs.values), "training must change the trained job"
    assert np.array_equal(b_before.tokens.values, b_after.tokens.values)
    assert np.array_equal(b_lp_before.logprobs.values, b_lp_after.logprobs.values)
    root = Path(embedded.checkpoint_root) / "local" / "isolation"
    w0, w1 = _weights(root / "b0"), _weights(root / "b1")
    assert w0.keys() == w1.keys() and all(np.array_equal(w0[k], w1[k]) for k in w0)


async def test_checkpoint_paths_stay_in_the_tenants_folder(cluster: Client, tiny_model: Path) -> None:
    async with plexrl.job("confined", model=tiny_model) as job:
        for path in ("/tmp/anywhere", "../escape", "a/../../escape"):
            with pytest.raises(CheckpointPathError):
                await job.save(path)
            with pytest.raises(CheckpointPathError):
                await job.load(path)
        assert (await job.sync_weights()).weight_version == 1  # the job goes on


def _weights(checkpoint: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no weights in {checkpoint}"
    return out


async def test_forward_backward_and_optim_step_may_be_submitted_before_either_is_awaited(
    cluster: Client, tiny_model: Path
) -> None:
    async with plexrl.job("pipelined", model=tiny_model) as job:
        gen = await plexrl.generate(PROMPTS, plexrl.SamplingParams(n=2, max_tokens=4))
        batch = plexrl.Batch.from_samples(PROMPTS, gen.samples, advantages=np.linspace(-1, 1, len(gen.samples)))
        fb = plexrl.forward_backward(batch, loss="grpo")
        step = plexrl.optim_step()
        sync = plexrl.sync_weights()
        assert (await step).step == 1
        assert np.isfinite((await fb).loss)
        assert (await sync).weight_version == 1
        again = await job.generate(PROMPTS[:1], plexrl.SamplingParams(max_tokens=2))
        assert again.weight_version == 1


async def test_status_reports_workers_and_open_jobs(
    cluster: Client, embedded: plexrl.LocalCluster, tiny_model: Path
) -> None:
    async with plexrl.job("visible", model=tiny_model) as job:
        status = await cluster.status()
        assert [w.name for w in status.workers] == ["local-0"]
        (info,) = [j for j in status.jobs if j.job_id == job.job_id]
        assert info.state == "open" and info.worker_id == status.workers[0].worker_id
        await job.generate(PROMPTS, GREEDY)
        stats = await job.stats()
        assert stats.tier == "device" and stats.state_bytes > 0 and stats.calls_done == 2  # open, generate
        assert 0 < stats.accelerator_s < stats.wall_s and stats.swaps == 0
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plexrl", "status", "--coordinator", cluster.address,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, **embedded.client_env()},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(cli.communicate(), timeout=60)
        assert cli.returncode == 0
        row = next(line for line in out.decode().splitlines() if line.startswith(job.job_id))
        assert row.split()[1:4] == [info.worker_id, "open", "device"]
    assert job.job_id not in [j.job_id for j in (await cluster.status()).jobs]


async def test_a_call_past_its_deadline_fails_and_never_runs(embedded: plexrl.LocalCluster, tiny_model: Path) -> None:
    """A sync_weights queued behind a long generate, with a deadline shorter than the generate:
    CallTimeoutError at once, the queued call dropped (the next sync publishes version 1)."""
    async with (
        plexrl.connect(embedded.address, credentials=embedded.credentials(), deadlines={"sync_weights": 0.05}) as hasty,
        plexrl.job("deadlines", model=tiny_model, client=hasty) as job,
    ):
        running = job.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=4, max_tokens=128))
        with pytest.raises(plexrl.errors.CallTimeoutError, match=r"deadline of 0\.05 s"):
            await job.sync_weights()
        assert len((await running).samples) == 128
        hasty.deadlines["sync_weights"] = 60.0
        assert (await job.sync_weights()).weight_version == 1


async def test_cancelled_and_aborted_calls(cluster: Client, tiny_model: Path) -> None:
    """A queued call that is cancelled (or aborted) never runs; a running call the engine cannot
    interrupt (the hf sampler) runs to its end and an abort then changes nothing."""
    async with plexrl.job("cancels", model=tiny_model, client=cluster) as job:
        running = job.generate([[1, 5, 6]] * 16, plexrl.SamplingParams(n=4, max_tokens=64))
        cancelled = job.sync_weights()
        aborted = job.sync_weights()
        cancelled.cancel()
        cluster.abort(aborted)
        cluster.abort(running)
        with pytest.raises(plexrl.errors.CallAbortedError, match="cancelled before it ran"):
            await aborted
        assert len((await running).samples) == 64
        # Neither sync ran: this one publishes version 1.
        assert (await job.sync_weights()).weight_version == 1
