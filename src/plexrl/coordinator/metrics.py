"""The coordinator's Prometheus endpoint (``plexrl coordinator --metrics-port N``): what
``plexrl status`` shows an admin, as metrics, and every call's time queued and running.

Names and labels are stable (docs/cluster.md, "Metrics", lists them). Gauges and counters are read from the
coordinator at scrape time, on its event loop (the HTTP server runs in a thread of its own);
the call-latency histograms are observed as calls finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plexrl.protocol import calls
from plexrl.protocol import messages as m

SCRAPE_TIMEOUT_S = 5.0
# Seconds: a decode step of a small model to a long rollout or a model load.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, float("inf"))


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
        kind, outcome = calls.CALL_KIND[type(call)], ("error" if error else "ok")
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
        yield from _families(WORKER_METRICS, ["worker", "name", "device", "role"], status.workers,
                             lambda w: [w.worker_id, w.name, w.device, w.role])  # fmt: skip
        yield from _families(JOB_METRICS, ["job", "name", "tenant", "worker"], status.jobs,
                             lambda j: [j.job_id, j.name, j.owner, j.worker_id])  # fmt: skip


# (name, counter or gauge, help, value): one family per row, one sample per worker / job.
WORKER_METRICS: list[tuple[str, bool, str, Callable[[Any], float]]] = [
    ("plexrl_worker_busy_seconds", True, "Seconds a worker ran a call", lambda w: w.busy_s),
    ("plexrl_worker_calls", True, "Calls a worker finished", lambda w: w.calls_done),
    ("plexrl_worker_state_bytes", False, "Jobs' state on a worker's device", lambda w: w.state_bytes_on_device),
    ("plexrl_worker_memory_budget_bytes", False, "A worker's device budget for jobs' state",
     lambda w: w.memory_budget_bytes),
    ("plexrl_worker_role_moves", True, "A worker's moves between training and rollout", lambda w: w.role_moves),
    ("plexrl_worker_joins", True, "Times a rollout worker joined a job's training", lambda w: w.joins),
]  # fmt: skip
JOB_METRICS: list[tuple[str, bool, str, Callable[[Any], float]]] = [
    ("plexrl_job_accelerator_seconds", True, "Device-seconds charged to a job", lambda j: j.accelerator_s),
    ("plexrl_job_swaps", True, "Moves of a job's state between device and host", lambda j: j.swaps),
    ("plexrl_job_swap_bytes", True, "Bytes of those moves", lambda j: j.swap_bytes),
    ("plexrl_job_swap_seconds", True, "Seconds of those moves", lambda j: j.swap_s),
    ("plexrl_job_queued_calls", False, "A job's calls waiting at the coordinator", lambda j: j.queued),
    ("plexrl_job_running", False, "1 while a call of the job runs", lambda j: 1.0 if j.running else 0.0),
]  # fmt: skip


def _families(
    metrics: list[tuple[str, bool, str, Callable[[Any], float]]],
    labels: list[str],
    items: list[Any],
    label_values: Callable[[Any], list[str]],
) -> Iterator[Any]:
    for name, counter, doc, value in metrics:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=labels)
        for item in items:
            family.add_metric(label_values(item), value(item))
        yield family
