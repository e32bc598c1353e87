"""Observability of a real run (coordinator and worker processes): the Prometheus endpoint, scraped
during it (workers' busy time, jobs' accelerator-seconds, the calls' queue and run times), and
``plexrl trace``'s file of its calls (a valid trace, a tenant's own jobs only)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import plexrl
from plexrl.errors import CallFailedError
from plexrl.protocol import auth
from plexrl.trace import JOBS_PID, check_trace, chrome_trace
from plexrl.types import Batch, Ragged, SamplingParams

pytestmark = pytest.mark.asyncio


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of every family at ``url``: name -> [(labels, value)]."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], metric: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(metric, []) if all(lab.get(k) == x for k, x in labels.items()))


async def test_a_scrape_during_a_run_shows_workers_jobs_and_call_latencies(tiny_model: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/metrics"
    async with plexrl.local(workers=1, metrics_port=port), plexrl.job("scraped", model=tiny_model) as job:
        before = await asyncio.to_thread(scrape, url)
        assert total(before, "plexrl_job_accelerator_seconds_total", name="scraped") >= 0
        assert len(before["plexrl_worker_busy_seconds_total"]) == 1
        await job.generate([[1, 5, 6]], SamplingParams(max_tokens=4))
        batch = Batch(tokens=Ragged.from_rows([[1, 5, 6, 7, 8]], "int32"), prompt_lens_B=np.array([2], np.int32))
        await job.forward_backward(batch, "cross_entropy")
        await job.optim_step()
        with pytest.raises(CallFailedError):
            await job.optim_step()  # no gradients: a failed call
        after = await asyncio.to_thread(scrape, url)
    assert total(after, "plexrl_call_run_seconds_count", kind="generate", outcome="ok") == 1
    assert total(after, "plexrl_call_run_seconds_count", kind="forward_backward", outcome="ok") == 1
    assert total(after, "plexrl_call_run_seconds_count", kind="optim_step", outcome="ok") == 1
    assert total(after, "plexrl_call_run_seconds_count", kind="optim_step", outcome="error") == 1
    assert total(after, "plexrl_call_queue_seconds_count", kind="open") == 1
    assert total(after, "plexrl_call_run_seconds_sum", kind="open") > 0  # a model load takes time
    busy = total(after, "plexrl_worker_busy_seconds_total")
    assert busy > total(before, "plexrl_worker_busy_seconds_total")
    assert total(after, "plexrl_worker_calls_total") >= 5  # open, generate, forward_backward, 2 optim_steps
    accel = total(after, "plexrl_job_accelerator_seconds_total", name="scraped")
    assert 0 < accel <= busy + 1e-6  # the job's charge is its share of the worker's busy time
    assert [lab["tenant"] for lab, _ in after["plexrl_job_accelerator_seconds_total"]] == ["local"]


async def test_plexrl_trace_writes_a_valid_trace_of_the_calls_and_a_tenant_sees_its_own(
    tiny_model: Path, tmp_path: Path
) -> None:
    cluster = plexrl.local(workers=1)
    async with cluster, plexrl.job("traced", model=tiny_model) as job:
        for _ in range(3):
            await job.generate([[1, 5, 6]], SamplingParams(max_tokens=4))
        await job.sync_weights()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plexrl", "trace", "--coordinator", cluster.address, "--out", str(tmp_path / "t.json"),
            "--png", str(tmp_path / "t.png"),
            stdout=asyncio.subprocess.PIPE, env={**os.environ, **cluster.client_env()},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(cli.communicate(), timeout=60)
        assert cli.returncode == 0 and b"t.json" in out
        assert cluster.keys is not None
        secret = auth.add_key(cluster.keys, "other", "client")
        creds = auth.Credentials.load(secret, cluster.keys / "coordinator.key")
        async with plexrl.connect(cluster.address, credentials=creds) as other:
            assert (await other.trace()).spans == []  # another tenant's calls are not theirs to see
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the picture of it
    trace = json.loads((tmp_path / "t.json").read_text())
    check_trace(trace)
    mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == JOBS_PID and e["cat"] == "call"]
    assert [e["name"] for e in mine] == ["open", "generate", "generate", "generate", "sync_weights"]
    assert all(e["args"]["device"] == "local-0" and e["args"]["outcome"] == "ok" for e in mine)
    starts = [e["ts"] for e in mine]
    assert starts == sorted(starts) and all(e["dur"] > 0 for e in mine)


async def test_a_trace_shows_state_swaps_on_the_device_and_tool_waits_on_the_job(tiny_model: Path) -> None:
    """Two jobs under a budget that holds one job's state: their calls move state in and out. A
    trajectory's reported tool latency becomes a ``tool`` span before its next turn."""
    cluster = plexrl.local(workers=1, policy="plex", memory_budget_bytes=(3 << 20) // 2)  # 1.5 jobs' state
    async with (
        cluster,
        plexrl.job("first", model=tiny_model) as first,
        plexrl.job("second", model=tiny_model) as second,
    ):
        for _ in range(2):
            for job in (first, second):
                await job.generate([[1, 5, 6]], SamplingParams(max_tokens=2))
        traj = first.trajectory([1, 5, 6], max_turns=2)
        assert await traj.generate(SamplingParams(max_tokens=2)) is not None
        traj.observe([7, 8], ok=True, latency_s=0.25)
        await traj.generate(SamplingParams(max_tokens=2))
        assert cluster.client is not None
        spans = (await cluster.client.trace()).spans
    swaps = [s for s in spans if s.kind.startswith("swap_to_")]
    assert {s.kind for s in swaps} == {"swap_to_host", "swap_to_device"} and all(s.device == "local-0" for s in swaps)
    (tool,) = [s for s in spans if s.kind == "tool"]
    assert tool.job == first.job_id and tool.device == "" and tool.end_s - tool.start_s == pytest.approx(0.25)
    turns = [s for s in spans if s.job == first.job_id and s.kind == "generate"]
    assert turns[-1].start_s >= tool.end_s  # the turn after the tool ran after it
    check_trace(chrome_trace(spans))
