"""Accounting: who used each device for how long, and what moving state cost (pure, scheduler clock).

A job's accelerator-seconds are its exclusive call time, plus its share of time a device spent
on several calls at once (a vLLM worker batching many jobs' generates: each of ``n`` running
calls is charged ``1/n`` of the time), plus the transitions done for it. A device is busy while
it runs at least one call. What a job would pay on a dedicated device is its wall time there.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class JobUsage:
    opened_s: float
    closed_s: float | None = None
    accelerator_s: float = 0.0
    calls: int = 0
    swaps: int = 0
    swap_bytes: int = 0
    swap_s: float = 0.0

    def wall_s(self, now: float) -> float:
        return (self.closed_s if self.closed_s is not None else now) - self.opened_s


@dataclass(slots=True)
class DeviceUsage:
    since: float = 0.0  # the last time the running set changed
    busy_s: float = 0.0
    running: dict[str, int] = field(default_factory=dict)  # job -> its calls running here
    calls: int = 0  # calls running here (the sum of ``running``)


class Ledger:
    def __init__(self) -> None:
        self.jobs: dict[str, JobUsage] = {}
        self.devices: dict[str, DeviceUsage] = {}
        self._on: dict[str, set[str]] = {}  # job -> devices running a call of it

    def job_opened(self, job_id: str, now: float) -> None:
        self.jobs[job_id] = JobUsage(opened_s=now)

    def job_closed(self, job_id: str, now: float) -> None:
        usage = self.jobs.get(job_id)
        if usage is not None and usage.closed_s is None:
            usage.closed_s = now

    def call_started(self, worker_id: str, job_id: str, now: float) -> None:
        device = self._settle(worker_id, now)
        device.running[job_id] = device.running.get(job_id, 0) + 1
        device.calls += 1
        self._on.setdefault(job_id, set()).add(worker_id)
        if job_id in self.jobs:
            self.jobs[job_id].calls += 1

    def call_finished(self, worker_id: str, job_id: str, now: float) -> None:
        device = self._settle(worker_id, now)
        left = device.running.get(job_id, 0) - 1
        if job_id in device.running:
            device.calls -= 1
        if left > 0:
            device.running[job_id] = left
        else:
            device.running.pop(job_id, None)
            self._on.get(job_id, set()).discard(worker_id)

    def swapped(self, job_id: str, moved_bytes: int, seconds: float) -> None:
        usage = self.jobs.get(job_id)
        if usage is not None:
            usage.swaps += 1
            usage.swap_bytes += moved_bytes
            usage.swap_s += seconds
            usage.accelerator_s += seconds

    def busy_s(self, worker_id: str, now: float) -> float:
        return self._settle(worker_id, now).busy_s

    def accelerator_s(self, job_id: str, now: float) -> float:
        """Settled up to ``now`` on every device the job runs on."""
        for worker_id in sorted(self._on.get(job_id, ())):
            self._settle(worker_id, now)
        usage = self.jobs.get(job_id)
        return usage.accelerator_s if usage is not None else 0.0

    def _settle(self, worker_id: str, now: float) -> DeviceUsage:
        device = self.devices.get(worker_id)
        if device is None:
            device = self.devices[worker_id] = DeviceUsage(since=now)
        n = device.calls
        dt = now - device.since
        if n and dt > 0:
            device.busy_s += dt
            jobs = self.jobs
            for job_id, k in device.running.items():
                if job_id in jobs:
                    jobs[job_id].accelerator_s += dt * k / n
        device.since = now
        return device
