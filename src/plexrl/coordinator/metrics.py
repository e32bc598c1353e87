"""The coordinator's Prometheus endpoint (``plexrl coordinator --metrics-port N``): what
``plexrl status`` shows an admin, as metrics, and every call's time queued and running.

Names and labels are stable (README "Metrics" lists them). Gauges and counters are read from the
coordinator at scrape time, on its event loop (the HTTP server runs in a thread of its own);
the call-latency histograms are observed as calls finish.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plexrl.protocol import messages as m

SCRAPE_TIMEOUT_S = 5.0
# Seconds: a decode step of a small model to a long rollout or a model load.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, float("inf"))


def call_kind(call: Any) -> str:
    """``ForwardBackward`` -> ``forward_backward``: a call's kind as a label."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(call).__name__).lower()


class Metrics:
    """The coordinator's registry: call latencies it observes, and a collector of its status."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("kind", "outcome")
        self.queue_s = Histogram("plexrl_call_queue_seconds", "Time a call waited at the coordinator before a "
                                 "worker took it", labels, registry=self.registry, buckets=BUCKETS)  # fmt: skip
        self.run_s = Histogram("plexrl_call_run_seconds", "Time from a call's dispatch to its outcome",
                               labels, registry=self.registry, buckets=BUCKETS)  # fmt: skip

    def observe(self, call: Any, error: bool, queued_s: float, run_s: float) -> None:
        kind, outcome = call_kind(call), ("error" if error else "ok")
        self.queue_s.labels(kind, outcome).observe(queued_s)
        self.run_s.labels(kind, outcome).observe(run_s)

    def serve(
        self, host: str, port: int, status: Callable[[], Awaitable[m.StatusReply]], loop: asyncio.AbstractEventLoop
    ) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a thread; returns the port."""
        self.registry.register(_StatusCollector(status, loop))
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()


class _StatusCollector(Collector):
    def __init__(self, status: Callable[[], Awaitable[m.StatusReply]], loop: asyncio.AbstractEventLoop) -> None:
        self._status = status
        self._loop = loop

    async def _scrape(self) -> m.StatusReply:
        return await self._status()

    def collect(self) -> Iterator[Any]:
        scrape = asyncio.run_coroutine_threadsafe(self._scrape(), self._loop)
        status: m.StatusReply = scrape.result(SCRAPE_TIMEOUT_S)
        yield GaugeMetricFamily("plexrl_uptime_seconds", "Seconds since the coordinator started", status.uptime_s)
        w_labels = ["worker", "name", "device", "role"]
        busy = CounterMetricFamily("plexrl_worker_busy_seconds", "Seconds a worker ran a call", labels=w_labels)
        calls = CounterMetricFamily("plexrl_worker_calls", "Calls a worker finished", labels=w_labels)
        used = GaugeMetricFamily("plexrl_worker_state_bytes", "Jobs' state on a worker's device", labels=w_labels)
        budget = GaugeMetricFamily("plexrl_worker_memory_budget_bytes", "A worker's device budget for jobs' state",
                                   labels=w_labels)  # fmt: skip
        moves = CounterMetricFamily("plexrl_worker_role_moves", "A worker's moves between training and rollout",
                                    labels=w_labels)  # fmt: skip
        for w in status.workers:
            values = [w.worker_id, w.name, w.device, w.role]
            busy.add_metric(values, w.busy_s)
            calls.add_metric(values, w.calls_done)
            used.add_metric(values, w.state_bytes_on_device)
            budget.add_metric(values, w.memory_budget_bytes)
            moves.add_metric(values, w.role_moves)
        yield from (busy, calls, used, budget, moves)
        j_labels = ["job", "name", "tenant", "worker"]
        accel = CounterMetricFamily("plexrl_job_accelerator_seconds", "Device-seconds charged to a job",
                                    labels=j_labels)  # fmt: skip
        swaps = CounterMetricFamily("plexrl_job_swaps", "Moves of a job's state between device and host",
                                    labels=j_labels)  # fmt: skip
        swap_bytes = CounterMetricFamily("plexrl_job_swap_bytes", "Bytes of those moves", labels=j_labels)
        swap_s = CounterMetricFamily("plexrl_job_swap_seconds", "Seconds of those moves", labels=j_labels)
        queued = GaugeMetricFamily("plexrl_job_queued_calls", "A job's calls waiting at the coordinator",
                                   labels=j_labels)  # fmt: skip
        running = GaugeMetricFamily("plexrl_job_running", "1 while a call of the job runs", labels=j_labels)
        for j in status.jobs:
            values = [j.job_id, j.name, j.owner, j.worker_id]
            accel.add_metric(values, j.accelerator_s)
            swaps.add_metric(values, j.swaps)
            swap_bytes.add_metric(values, j.swap_bytes)
            swap_s.add_metric(values, j.swap_s)
            queued.add_metric(values, j.queued)
            running.add_metric(values, 1.0 if j.running else 0.0)
        yield from (accel, swaps, swap_bytes, swap_s, queued, running)
