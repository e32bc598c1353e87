"""What the coordinator reports: ``plexrl status`` (workers and jobs, another tenant's redacted),
the trace of finished calls (``plexrl trace``) and the metrics' latency histograms."""

from __future__ import annotations

import collections
from collections.abc import Callable

from plexrl.coordinator import scheduler as sch
from plexrl.coordinator.metrics import Metrics
from plexrl.coordinator.records import CallRecord, JobRecord, Peer, WorkerRecord, status, wire_bytes
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.trace import Span

TRACE_SPANS = 100_000  # the most recent calls kept for `plexrl trace`


class Reports:
    """Status and trace replies over the coordinator's tables (shared, read here) and the
    scheduler's facts; ``owner_name`` shows a tenant (its key's name with keys)."""

    def __init__(
        self,
        scheduler: sch.Scheduler,
        workers: dict[str, WorkerRecord],
        jobs: dict[str, JobRecord],
        owner_name: Callable[[str], str],
        metrics: Metrics | None,
        clock: Callable[[], float],
    ) -> None:
        self._scheduler = scheduler
        self._workers = workers
        self._jobs = jobs
        self._owner_name = owner_name
        self.metrics = metrics
        # Finished calls as spans (the job's owner beside each), the most recent TRACE_SPANS.
        self._spans: collections.deque[tuple[str, Span]] = collections.deque(maxlen=TRACE_SPANS)
        self._spans_recorded = 0
        self._now = clock
        self._clock_zero = clock()

    # -- trace ----------------------------------------------------------------------------------

    def call_span(self, worker_id: str, rec: CallRecord, error: bool, owner: str) -> None:
        """A finished call into the trace (and the metrics' latency histograms)."""
        finished = self._now()
        queued, ran = rec.dispatched_at - rec.submitted_at, finished - rec.dispatched_at
        call = rec.sent or rec.call
        if self.metrics is not None:
            self.metrics.observe(call, error, queued, ran)
        start = rec.dispatched_at - self._clock_zero
        span = Span(device=self.device_name(worker_id), job=rec.job_id, kind=calls.CALL_KIND[type(call)], start_s=start,
                    end_s=start + ran, queued_s=queued, outcome="error" if error else "ok")  # fmt: skip
        self.record(owner, span)

    def span(self, owner: str, worker_id: str, job_id: str, kind: str, seconds: float, error: bool = False) -> None:
        """Something that just ended after ``seconds`` (a swap, a sleep, a tool wait) into the trace."""
        now = self._now() - self._clock_zero
        device = self.device_name(worker_id) if worker_id else ""
        self.record(owner, Span(device, job_id, kind, now - seconds, now, outcome="error" if error else "ok"))

    def record(self, owner: str, span: Span) -> None:
        self._spans.append((owner, span))
        self._spans_recorded += 1

    def device_name(self, worker_id: str) -> str:
        worker = self._workers.get(worker_id)
        return worker.info.name if worker is not None else worker_id

    def trace(self, rid: int, asker: Peer) -> m.TraceReply:
        """The asker's jobs' spans (an admin's: everyone's)."""
        spans = [s for owner, s in self._spans if asker.admin or owner == asker.tenant]
        return m.TraceReply(rid=rid, spans=spans, dropped=self._spans_recorded - len(self._spans))

    # -- status ---------------------------------------------------------------------------------

    def status(self, rid: int, asker: Peer, now: float, uptime_s: float) -> m.StatusReply:
        """Workers, and jobs: the asker's own in full; other tenants' without names or details
        (where they run and their state only), unless the asker is an admin."""

        def visible(j: JobRecord) -> bool:
            return asker.admin or j.owner == asker.tenant

        roles = {w.worker_id: w for w in self._scheduler.workers()}
        workers = [
            m.WorkerInfo(
                worker_id=w.worker_id,
                name=w.info.name,
                device=w.info.device,
                engines=w.info.engines,
                memory_budget_bytes=wire_bytes(self._scheduler.budget(w.worker_id)),
                jobs=sorted(
                    j.job_id if visible(j) else ""
                    for j in self._jobs.values()
                    if self._scheduler.view(j.job_id).home == w.worker_id
                ),
                calls_done=w.calls_done,
                busy_s=self._scheduler.busy_s(w.worker_id, now),
                pid=w.info.pid,
                state_bytes_on_device=self._scheduler.used_bytes(w.worker_id),
                role=roles[w.worker_id].role,
                bucket=roles[w.worker_id].bucket,
                role_moves=w.role_moves,
                joins=w.joins,
            )
            for w in self._workers.values()
        ]
        jobs = [self._job_info(j, now) if visible(j) else self._redacted(j) for j in self._jobs.values()]
        return m.StatusReply(rid=rid, workers=workers, jobs=jobs, uptime_s=uptime_s)

    def _job_info(self, j: JobRecord, now: float) -> m.JobInfo:
        ledger = self._scheduler.ledger
        usage = ledger.jobs.get(j.job_id)
        residency = self._scheduler.residency(j.job_id)
        view = self._scheduler.view(j.job_id)
        return m.JobInfo(
            job_id=j.job_id,
            name=j.name,
            owner=self._owner_name(j.owner),
            worker_id=view.home,
            queued=self._scheduler.queued(j.job_id),
            running=self._scheduler.is_running(j.job_id),
            calls_done=j.calls_done,
            state=status(j, self._scheduler.view(j.job_id)),
            tier=residency.tier if residency else "",
            sampler_worker_id=view.sampler,
            state_bytes=residency.state_bytes if residency else 0,
            wall_s=usage.wall_s(now) if usage else 0.0,
            accelerator_s=ledger.accelerator_s(j.job_id, now),
            swaps=usage.swaps if usage else 0,
            swap_bytes=usage.swap_bytes if usage else 0,
            swap_s=usage.swap_s if usage else 0.0,
            recoveries=j.recoveries,
            members=list(view.members),
        )

    def _redacted(self, j: JobRecord) -> m.JobInfo:
        """Another tenant's job as ``plexrl status`` shows it: where it runs and its state, nothing else."""
        return m.JobInfo(job_id="", name="", owner="", worker_id=self._scheduler.view(j.job_id).home, queued=0, running=False,
                         calls_done=0, state=status(j, self._scheduler.view(j.job_id)))  # fmt: skip
