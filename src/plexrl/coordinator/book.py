"""The coordinator's book of jobs and calls as its clients see them: opening, submitting and
cancelling calls, each call's outcome and its job's commit point (journaled), clients' leases and
reattaching, and the calls built for the scheduler's own (a restore, a disaggregated
job's follow-on, a pooled job's replicas, releases). Where jobs run and when calls start is the
scheduler's; sockets and workers are the server's (``server.py``), reached through callbacks."""

from __future__ import annotations

import collections
import itertools
import logging
import re
from collections.abc import Callable

import msgspec

from plexrl.coordinator import events as ev
from plexrl.coordinator import records
from plexrl.coordinator import scheduler as sch
from plexrl.coordinator.config import CoordinatorConfig
from plexrl.coordinator.journal import Journal
from plexrl.coordinator.records import CallRecord, JobRecord, Peer, ReattachWaiter, WorkerRecord
from plexrl.coordinator.reports import Reports
from plexrl.errors import (
    CallAbortedError,
    GangBrokenError,
    InvalidRequestError,
    JobClosedError,
    JobSuspendedError,
    NotJobOwnerError,
    PlexError,
    TooManyCallsError,
    UnknownJobError,
)
from plexrl.names import PLACEMENTS, JobStatus
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m

log = logging.getLogger("plexrl.coordinator")

_JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Book:
    """The jobs and calls tables (``jobs`` is shared with the reports) and what happens to them."""

    def __init__(
        self,
        config: CoordinatorConfig,
        scheduler: sch.Scheduler,
        reports: Reports,
        jobs: dict[str, JobRecord],
        workers: dict[str, WorkerRecord],
        peers: dict[bytes, Peer],
        allowlist: auth.Allowlist | None,
        send: Callable[[bytes, msgspec.Struct], None],
        apply: Callable[[ev.Event], None],
        carry_out: Callable[[ev.Action], None],
    ) -> None:
        self.config = config
        self._now = config.clock
        self._scheduler = scheduler
        self._reports = reports
        self._jobs = jobs
        self._workers = workers  # the server's: for a worker's connection
        self._peers = peers  # the server's: each connection's tenant
        self._send = send
        self._apply = apply  # an event into the scheduler, its actions carried out
        self._carry_out = carry_out
        self._allowlist = allowlist  # the server's, with keys: a tenant's key's name
        self._journal = None if config.journal is None else Journal(config.journal)
        self._calls: dict[int, CallRecord] = {}
        self._call_of: dict[tuple[bytes, int], int] = {}  # (client, its request id) -> call id
        self._reattach_waiters: list[ReattachWaiter] = []
        self._calls_of_tenant: collections.Counter[str] = collections.Counter()
        self._bytes_of_tenant: collections.Counter[str] = collections.Counter()
        self._call_ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        if self._journal is not None:
            self._job_ids = itertools.count(max(1, self._journal.counter("next_job")))
        # Calls no client waits for, sent for ``Replicate`` and ``Release``: call id -> (worker, job,
        # whether a failure matters: a replica's open or weights, which the scheduler hears of).
        self._side_calls: dict[int, tuple[str, str, bool]] = {}
        # Disaggregated jobs' barriers done on their homes, held for their follow-ons (``_hold``).
        self._held: dict[str, tuple[CallRecord, m.CallDone]] = {}

    def job(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def fail_calls(self, err: PlexError) -> None:
        """Every caller hears ``err`` (the coordinator is going without a journal)."""
        for rec in [*self._calls.values(), *(r for r, _ in self._held.values())]:
            self._reply_error(rec.client, rec.client_rid, err)
        self._calls.clear()
        self._held.clear()
        self._call_of.clear()

    def forget_worker(self, worker_id: str) -> None:
        """A lost worker's answers to side calls will not come."""
        for call_id in [c for c, (w, _, _) in self._side_calls.items() if w == worker_id]:
            del self._side_calls[call_id]

    def lose_client(self, ident: bytes) -> None:
        """A client silent for the liveness window: its calls are cancelled, its jobs suspended."""
        self._reattach_waiters = [w for w in self._reattach_waiters if w.client != ident]
        for rec in [r for r in self._calls.values() if r.client == ident]:
            self.cancel(ident, rec.client_rid)
        for job in [j for j in self._jobs.values() if j.client == ident and self._status(j) == "open"]:
            job.suspended, job.suspended_at = True, self._now()
            log.warning("job %s suspended: its client went silent (grace %g s)", job.job_id, self.config.client_grace_s)
            if self.config.client_grace_s <= 0:
                self._free(job, "its client went away (no grace period)")
            else:
                self._serve_reattach(job)
        for job in [j for j in self._jobs.values() if j.client == ident and self._status(j) == "lost"]:
            self._free(job, "its client went away")

    def free_unclaimed(self, now: float) -> None:
        """Close the suspended jobs whose client did not reattach within the grace period."""
        grace = self.config.client_grace_s
        for job in [j for j in self._jobs.values() if self._status(j) == "suspended"]:
            if now - job.suspended_at >= grace:
                self._free(job, f"its client went away and did not reattach within {grace:g} s")

    def _status(self, job: JobRecord) -> JobStatus:
        return records.status(job, self._scheduler.view(job.job_id))

    def _reply_error(self, ident: bytes, rid: int, err: PlexError) -> None:
        self._send(ident, m.ErrorReply(rid=rid, code=err.code, message=err.message))

    def _send_worker(self, worker_id: str, msg: msgspec.Struct) -> None:
        self._send(self._workers[worker_id].ident, msg)

    def resume_journaled(self) -> None:
        """Take back the jobs of the journal: each waits, suspended, for its client to reattach,
        and is rebuilt on a worker (a ``restore`` from its snapshot and the calls since) as soon
        as one can take it."""
        if self._journal is None:
            return
        now = self._now()
        for found in self._journal.jobs():
            row = found.row
            job = self._jobs[row.job_id] = records.resumed(found, now)
            log.warning("job %s resumed from the journal (its calls up to %d)", job.job_id, job.committed_seq)
            resumed = ev.JobResumed(job.job_id, row.opened.state_bytes, weight=row.weight, base=row.open.spec.model)
            self._apply(resumed)

    def open_job(self, ident: bytes, msg: m.OpenJob) -> None:
        if not _JOB_NAME.match(msg.name):
            raise InvalidRequestError(
                f"job name {msg.name!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        if not msg.weight > 0:
            raise InvalidRequestError(f"job weight {msg.weight} must be > 0 (1.0 is an equal share)")
        if msg.placement not in PLACEMENTS:
            raise InvalidRequestError(f"placement {msg.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        number = next(self._job_ids)
        job_id = f"{msg.name}-{number}"
        if self._journal is not None:  # a restarted coordinator never reuses a job id
            self._journal.set_counter("next_job", number + 1)
        call_id = next(self._call_ids)
        disaggregated = msg.placement == "disaggregated"
        snapshot_max_bytes = 0 if disaggregated else self.config.snapshot_max_bytes  # see Recover
        open_call = calls.Open(spec=msg.spec, tenant=self._tenant_folder(ident), snapshot_max_bytes=snapshot_max_bytes)
        self._calls[call_id] = CallRecord(call_id, job_id, ident, msg.rid, open_call, submitted_at=self._now())
        # Its state's size is known once the worker opened it (JobSized).
        pooled = msg.placement == "pooled"
        opened = ev.JobOpened(
            job_id, weight=msg.weight, base=msg.spec.model, disaggregated=disaggregated, pooled=pooled, shape=msg.shape,
            devices=msg.devices,
        )  # fmt: skip
        for action in self._scheduler.handle(opened, self._now()):
            if isinstance(action, ev.Place):
                self._jobs[job_id] = JobRecord(
                    job_id, msg.name, self._peers[ident].tenant, msg.spec, client=ident, open=open_call,
                    weight=msg.weight, token=msg.token,
                )  # fmt: skip
                self._apply(ev.CallSubmitted(call_id, job_id, "open"))
            elif isinstance(action, ev.Fail) and action.call_id is None:  # the opening itself failed
                self._carry_out(ev.Fail(job_id, call_id, action.error))
            else:
                self._carry_out(action)

    def submit(self, ident: bytes, msg: m.Submit, nbytes: int) -> None:
        """A client's call: checked (``_check``), then queued for the scheduler; a close of a job
        whose state exists nowhere is done at once."""
        job = self._check(ident, msg)
        view = self._scheduler.view(job.job_id)
        if isinstance(msg.call, calls.Close) and (view.lost is not None or not view.home):
            # Lost, or waiting for a worker to be rebuilt on: its state exists nowhere, so closing
            # frees nothing (what a surviving worker holds of a lost job, the scheduler releases).
            self._remove_job(job.job_id)
            self._send(ident, m.CallDone(rid=msg.rid, job_id=job.job_id, result=calls.Closed()))
            return
        if view.lost is not None:
            raise type(view.lost)(view.lost.message)
        tenant = self._peers[ident].tenant
        if not isinstance(msg.call, calls.Close):
            self._check_limits(tenant, nbytes)
        self._queue(ident, job, msg, tenant, nbytes, view.pooled)

    def _check(self, ident: bytes, msg: m.Submit) -> JobRecord:
        """The submitted call's job, if the client may use it now and the call is valid."""
        job = self._jobs.get(msg.job_id)
        if job is None:
            raise UnknownJobError(f"no job {msg.job_id!r} on this coordinator: open one with plexrl.job(...) first")
        if job.owner != self._peers[ident].tenant:
            raise NotJobOwnerError(f"job {msg.job_id!r} belongs to another tenant; a client may only use its own jobs")
        status = self._status(job)
        if status == "closing":
            raise JobClosedError(f"job {msg.job_id!r} is closed: open a new job to keep going")
        if status == "suspended":
            raise JobSuspendedError(
                f"job {msg.job_id!r} lost its client and is suspended: take it over with client.reattach({job.name!r})"
            )
        if isinstance(msg.call, calls.Open | calls.SetWeights | calls.Restore):
            raise InvalidRequestError(
                f"{type(msg.call).__name__} calls are the coordinator's own: open jobs with OpenJob"
            )
        if msg.turn is not None and not isinstance(msg.call, calls.Generate):
            raise InvalidRequestError(f"only a generate can be a trajectory's turn, not {type(msg.call).__name__}")
        records.validate(msg.call)
        return job

    def _check_limits(self, tenant: str, nbytes: int) -> None:
        limit, byte_limit = self.config.max_calls_per_tenant, self.config.max_bytes_per_tenant
        if self._calls_of_tenant[tenant] >= limit:
            raise TooManyCallsError(
                f"{limit} of your calls are queued or running (the coordinator's --max-calls-per-tenant): "
                "await some before submitting more"
            )
        if self._bytes_of_tenant[tenant] + nbytes > byte_limit:
            raise TooManyCallsError(
                f"your queued and running calls hold {self._bytes_of_tenant[tenant]} bytes and this one "
                f"{nbytes}, over the coordinator's --max-bytes-per-tenant {byte_limit}: await some first"
            )

    def _queue(self, ident: bytes, job: JobRecord, msg: m.Submit, tenant: str, nbytes: int, pooled: bool) -> None:
        """Number the call in its job's order, seed a generate, and hand it to the scheduler."""
        call, seq = msg.call, msg.seq or job.next_seq
        job.next_seq = max(job.next_seq, seq + 1)
        if isinstance(call, calls.Generate):
            if call.params.seed is None:  # the client's Job seeds its generates; a raw Submit may not
                seed = calls.generate_seed(job.spec.seed, job.generates)  # so a retry elsewhere samples the same
                call = msgspec.structs.replace(call, params=msgspec.structs.replace(call.params, seed=seed))
            job.generates += 1
        call_id = next(self._call_ids)
        self._calls[call_id] = CallRecord(
            call_id, job.job_id, ident, msg.rid, call, tenant=tenant, nbytes=nbytes, seq=seq, submitted_at=self._now()
        )
        self._calls_of_tenant[tenant] += 1
        self._bytes_of_tenant[tenant] += nbytes
        self._call_of[(ident, msg.rid)] = call_id
        if msg.turn is not None and msg.turn.tool_s > 0:  # the tools the trajectory waited on before this turn
            self._reports.span(job.owner, "", job.job_id, "tool", msg.turn.tool_s)
        turn = msg.turn if pooled else None  # other jobs' generates run where their job's sampler is
        trajectory, signals = ("", ev.TurnSignals()) if turn is None else (turn.trajectory, records.signals(turn))
        kind = calls.CALL_KIND[type(msg.call)]
        self._apply(ev.CallSubmitted(call_id, job.job_id, kind, msg.priority, trajectory=trajectory, signals=signals))

    def cancel(self, ident: bytes, call_rid: int) -> None:
        """A queued call is dropped; a running one is aborted on its worker (if the engine can)."""
        call_id = self._call_of.get((ident, call_rid))
        rec = self._calls.get(call_id) if call_id is not None else None
        if rec is None or isinstance(rec.call, (calls.Open, calls.Close)):
            return  # finished already, or not something to cancel
        worker_id = self._scheduler.where(rec.call_id)
        if worker_id is None:
            self._forget(rec)
            self._apply(ev.CallCancelled(rec.call_id))
            self._reply_error(rec.client, rec.client_rid, CallAbortedError("the call was cancelled before it ran"))
        elif worker_id in self._workers:
            self._send_worker(worker_id, m.Abort(rid=rec.call_id))

    def reattach(self, ident: bytes, rid: int, name: str, job_id: str, token: str) -> None:
        tenant = self._peers[ident].tenant
        mine = [
            j for j in self._jobs.values()
            if j.owner == tenant and j.name == name and job_id in ("", j.job_id) and token in ("", j.token)
        ]  # fmt: skip
        suspended = [j for j in mine if self._status(j) == "suspended"]
        if suspended:
            job = max(suspended, key=lambda j: j.suspended_at)
            self._reattach_waiters.append(ReattachWaiter(ident, rid, tenant, name, job.job_id))
            self._serve_reattach(job)
        elif any(self._status(j) == "open" and j.client != ident for j in mine):
            self._reattach_waiters.append(ReattachWaiter(ident, rid, tenant, name, job_id))  # once its client is gone
        else:
            raise UnknownJobError(
                f"no job named {name!r}{f' ({job_id})' if job_id else ''} of yours is open or suspended here "
                "(a coordinator restarted without --journal forgets its jobs): open it with plexrl.job"
            )

    def _serve_reattach(self, job: JobRecord) -> None:
        """Hand a suspended job to a client waiting to reattach it, once the calls of its old
        client have finished (they may still change its state, and the commit point the new
        client hears must count them)."""
        busy = job.job_id in self._held or any(r.job_id == job.job_id and r.client for r in self._calls.values())
        if self._status(job) != "suspended" or busy:
            return
        waiter = next((w for w in self._reattach_waiters if w.wants(job)), None)
        if waiter is not None:
            self._reattach_waiters.remove(waiter)
            self._attach(job, waiter.client, waiter.rid)

    def _attach(self, job: JobRecord, ident: bytes, rid: int) -> None:
        if job.opened is None:  # it never finished opening
            self._free(job, "its client went away while it was opening")
            self._reply_error(ident, rid, UnknownJobError(f"job {job.name!r} was still opening when its client left"))
            return
        job.suspended, job.client = False, ident
        log.info("job %s reattached", job.job_id)
        attached = m.Reattached(
            rid=rid, job_id=job.job_id, name=job.name, spec=job.spec, opened=job.opened,
            committed_seq=job.committed_seq, committed=job.committed, weights_seq=job.weights_seq,
            next_seq=job.next_seq, generates=job.generates,
        )  # fmt: skip
        self._send(ident, attached)

    def _free(self, job: JobRecord, reason: str) -> None:
        """Close a job no client holds (its replies go nowhere)."""
        log.warning("closing job %s: %s", job.job_id, reason)
        for waiter in [w for w in self._reattach_waiters if w.wants(job)]:
            self._reattach_waiters.remove(waiter)
            self._reply_error(waiter.client, waiter.rid, UnknownJobError(f"job {job.name!r} was closed: {reason}"))
        if self._status(job) == "lost":
            self._remove_job(job.job_id)  # (what a surviving worker holds, the scheduler releases)
            return
        job.suspended, job.client = False, b""
        call_id = next(self._call_ids)
        self._calls[call_id] = CallRecord(call_id, job.job_id, b"", 0, calls.Close(), submitted_at=self._now())
        self._apply(ev.CallSubmitted(call_id, job.job_id, "close"))

    def on_call_outcome(self, worker_id: str, msg: m.CallDone | m.ErrorReply) -> None:
        if msg.rid in self._side_calls:
            self._side_call_done(worker_id, msg)
            return
        rec = self._calls.get(msg.rid)
        if rec is not None and rec.gang is not None and self._scheduler.where(rec.call_id) is not None:
            if worker_id not in rec.gang.members or worker_id in rec.gang.replies:
                log.warning("dropping outcome of call %d from worker %s: not a member it waits for", msg.rid, worker_id)
                return
            rec.gang.replies[worker_id] = msg
            answer = rec.gang.answer()
            if answer is None:
                return  # the other members' answers are still to come
            msg, worker_id = answer, rec.gang.members[0]
            if isinstance(msg, m.ErrorReply) and msg.code == GangBrokenError.code and rec.job_id in self._jobs:
                # Its members may differ now: rebuilt from its snapshot (the call runs again) or lost.
                log.warning("job %s: call %d broke its gang: %s", rec.job_id, rec.call_id, msg.message)
                self._apply(ev.GangBroken(rec.job_id, msg.message))
                return
        if rec is None or self._scheduler.where(rec.call_id) != worker_id:
            log.warning("dropping outcome of unknown call %d from worker %s", msg.rid, worker_id)
            return
        self._workers[worker_id].calls_done += 1
        if isinstance(msg, m.CallDone) and self._scheduler.follows_on(rec.call_id):
            self._hold(worker_id, rec, msg)  # the sampler worker does its part next; the caller hears then
            return
        self._forget(rec)
        job = self._jobs.get(rec.job_id)
        if job is not None:
            job.calls_done += 1
        if isinstance(msg, m.CallDone):
            result = rec.held.result if rec.held is not None else msg.result  # the home worker's
            if isinstance(result, calls.Synced) and isinstance(msg.result, calls.Synced) and msg.result.push_s:
                result = msgspec.structs.replace(result, push_s=msg.result.push_s)  # the sampler worker timed it
            if job is not None and self._scheduler.view(job.job_id).pooled:
                result = self._keep_weights(job, result)
            if isinstance(result, calls.Opened):
                self._apply(ev.JobSized(rec.job_id, result.state_bytes, snapshots=result.snapshots))
                if job is not None and isinstance(rec.call, calls.Open):
                    job.opened = result
                    if (
                        self._scheduler.view(job.job_id).recoverable and self._journal is not None
                    ):  # before its client hears
                        self._journal.opened(records.journal_row(job))
            if job is not None:
                result = self._commit(job, rec, result)
            if rec.client:  # not the coordinator's own call (a restore, a close nobody awaits)
                done = m.CallDone(rid=rec.client_rid, job_id=rec.job_id, result=result, compute_s=msg.compute_s)
                self._send(rec.client, done)
        elif rec.client:
            self._send(rec.client, m.ErrorReply(rid=rec.client_rid, code=msg.code, message=msg.message))
        error = msg.message if isinstance(msg, m.ErrorReply) else ""
        if rec.dispatched_at:
            self._reports.call_span(worker_id, rec, bool(error), job.owner if job is not None else "")
        self._apply(ev.CallFinished(rec.call_id, error=error))  # a failed open or restore fails the job's calls
        if rec.join and job is not None and not error:
            helpers = rec.gang.members[1:] if rec.gang is not None else ()
            log.info("workers %s join job %s's training", ", ".join(helpers), job.job_id)
            for helper in helpers:
                if helper in self._workers:
                    self._workers[helper].joins += 1
        elif isinstance(rec.call, calls.Restore) and job is not None and not error:  # (failed: JobLost)
            job.recoveries += 1
            log.warning("job %s recovered on worker %s (recovery %d)", job.job_id, worker_id, job.recoveries)
        opening_failed = isinstance(rec.call, calls.Open) and isinstance(msg, m.ErrorReply)
        if isinstance(rec.call, calls.Close) or opening_failed:
            self._remove_job(rec.job_id)
        elif job is not None:
            self._serve_reattach(job)

    def _commit(self, job: JobRecord, rec: CallRecord, result: calls.Result) -> calls.Result:
        """The job's commit point moves to ``rec`` (``records.commit``); a recoverable job's is
        journaled before the client hears. Returns the result for the client."""
        recoverable = self._scheduler.view(job.job_id).recoverable
        done = records.commit(job, rec, result, recoverable)
        if recoverable and self._journal is not None and isinstance(rec.call, records.STATEFUL):
            row = records.journal_row(job)
            self._journal.committed(row, snapshot=done.snapshot, replayed=done.replayed, n=len(job.replay))
        return done.result

    def _remove_job(self, job_id: str) -> None:
        """Forget a job (closed, never opened, or lost and let go): here, in the journal, and in
        the scheduler (whose leftover calls of it fail)."""
        self._jobs.pop(job_id, None)
        if self._journal is not None:
            self._journal.closed(job_id)
        self._apply(ev.JobClosed(job_id))

    def _hold(self, worker_id: str, rec: CallRecord, done: m.CallDone) -> None:
        """A disaggregated job's barrier is done on its home; the scheduler goes on with its part on
        the sampler worker (``_own_record``), and its caller hears once that is done."""
        del self._calls[rec.call_id]
        self._held[rec.job_id] = (rec, done)
        if isinstance(done.result, calls.Opened):
            self._apply(ev.JobSized(rec.job_id, done.result.state_bytes))
        job = self._jobs.get(rec.job_id)
        self._reports.call_span(worker_id, rec, False, job.owner if job is not None else "")
        self._apply(ev.CallFinished(rec.call_id))

    def _side_call(self, worker_id: str, job_id: str, call: calls.Call) -> None:
        call_id = next(self._call_ids)
        self._side_calls[call_id] = (worker_id, job_id, not isinstance(call, calls.Close))
        self._send_worker(worker_id, m.Execute(rid=call_id, job_id=job_id, call=call))

    def _side_call_done(self, worker_id: str, msg: m.CallDone | m.ErrorReply) -> None:
        """A replica's open or weights failed: the scheduler has the worker take them again (the turn
        sent behind them fails with the worker's error, which its caller hears). A release's answer
        is dropped."""
        sent_to, job_id, matters = self._side_calls.pop(msg.rid)
        if isinstance(msg, m.ErrorReply) and matters and sent_to == worker_id:
            log.error("worker %s could not take job %s's replica or weights: %s", worker_id, job_id, msg.message)
            self._apply(ev.ReplicaFailed(worker_id, job_id))

    def _keep_weights(self, job: JobRecord, result: calls.Result) -> calls.Result:
        """A pooled job's sync_weights or load exported its weights: kept for its rollout workers
        (``Replicate``), not passed on to the client."""
        weights = records.weights_of(result)
        if weights is None:
            return result
        job.weights = weights
        return records.without_weights(result)

    def _forget(self, rec: CallRecord) -> None:
        if self._calls.pop(rec.call_id, None) is not None and rec.tenant:
            self._calls_of_tenant[rec.tenant] -= 1
            self._bytes_of_tenant[rec.tenant] -= rec.nbytes
        self._call_of.pop((rec.client, rec.client_rid), None)

    def _recover(self, job: JobRecord, worker_id: str) -> None:
        """The scheduler moved ``job`` to ``worker_id`` (its calls that ran on the lost worker are
        queued again there, behind a restore of the scheduler's own: ``_own_record``)."""
        if worker_id:
            log.warning("job %s goes to worker %s", job.job_id, worker_id)
        else:
            log.warning("job %s waits for a worker that can take it", job.job_id)
        if not worker_id and self._status(job) == "closing":  # its state exists nowhere: the close is done
            for rec in [r for r in self._calls.values() if r.job_id == job.job_id and isinstance(r.call, calls.Close)]:
                self._forget(rec)
                if rec.client:
                    self._send(rec.client, m.CallDone(rid=rec.client_rid, job_id=job.job_id, result=calls.Closed()))
            self._remove_job(job.job_id)

    def _own_record(self, call_id: int, own: ev.OwnCall) -> CallRecord:
        """What is sent for a call of the scheduler's own, built from its job's record: a
        disaggregated job's follow-on (``records.follow_on``), or a restore from what ``_commit``
        kept."""
        job = self._jobs[own.job_id]
        if own.follows:
            held, done = self._held.pop(own.job_id)
            rec = self._calls[call_id] = records.follow_on(job, held, done, call_id, own, self._now())
            if rec.client:
                self._call_of[(rec.client, rec.client_rid)] = call_id
            return rec
        assert own.kind == "restore", own
        # A join's restore gives the helpers the state the home has: its weights were exported already.
        export = self._scheduler.view(job.job_id).pooled and not own.join
        rec = self._calls[call_id] = records.restore(job, call_id, export, self._now(), join=own.join)
        return rec

    def _gang_call(self, job_id: str, members: tuple[str, ...], rank: int) -> m.GangCall:
        """Member ``rank``'s part in a call of gang job ``job_id`` on ``members``: they meet at the
        leader's rendezvous store, in a process group named by the members and the job's epoch."""
        job = self._jobs.get(job_id)
        return m.GangCall(
            epoch=job.gang_epoch if job is not None else 0,
            rank=rank,
            world=len(members),
            store=self._workers[members[0]].info.rendezvous,
            token=f"{job_id}@{'+'.join(members)}",
            timeout_s=self.config.gang_timeout_s,
        )

    def _tenant_folder(self, ident: bytes) -> str:
        """The worker-side checkpoint folder of the tenant behind ``ident``: its key's name (every
        job of an unauthenticated coordinator shares one, ``shared``)."""
        return "" if self._allowlist is None else self._allowlist.name(self._peers[ident].tenant)

    def carry_out(self, action: ev.Action) -> bool:
        """Carry out a job's or call's action (the server carries out the workers'); whether it was one."""
        match action:
            case ev.Dispatch(call_id, worker_id, priority, exclusive, own):
                rec = self._calls[call_id] if own is None else self._own_record(call_id, own)
                rec.dispatched_at = self._now()
                call = rec.sent or rec.call
                job = self._jobs.get(rec.job_id)
                view = self._scheduler.view(job.job_id) if job is not None else None
                # A disaggregated job's sampler worker, or a pooled job's rollout workers, get the weights next.
                export = view is not None and (bool(view.sampler) or view.pooled)
                if export and isinstance(call, calls.SyncWeights):
                    via_coordinator = self.config.weights_via == "coordinator"
                    call = calls.SyncWeights(export=not via_coordinator, inline=via_coordinator)
                if export and isinstance(call, calls.Load):
                    call = msgspec.structs.replace(call, export=True)
                if view is not None and view.recoverable and isinstance(call, calls.OptimStep | calls.Load):
                    call = msgspec.structs.replace(call, snapshot=True)  # kept here: _commit
                execute = m.Execute(rid=call_id, job_id=rec.job_id, call=call, priority=priority, exclusive=exclusive)
                members = self._scheduler.members(call_id)
                rec.gang = records.GangWait(members) if members else None
                if members and isinstance(call, calls.Restore) and job is not None:
                    job.gang_epoch += 1  # a job restored on a gang (rebuilt, or widened) meets in a new process group
                for rank, member in enumerate(members or (worker_id,)):
                    gang = self._gang_call(rec.job_id, members, rank) if members else None
                    self._send_worker(member, msgspec.structs.replace(execute, gang=gang))
            case ev.Fail(job_id, call_id, error):
                failed = self._calls.get(call_id) if call_id is not None else None
                if failed is None and call_id is not None and call_id < 0 and job_id in self._held:
                    failed, _ = self._held.pop(job_id)  # its follow-on failed before it started
                    self._calls[failed.call_id] = failed
                if failed is not None:
                    self._forget(failed)
                    if failed.client:
                        self._reply_error(failed.client, failed.client_rid, error)
                    if (job := self._jobs.get(job_id)) is not None:
                        self._serve_reattach(job)
                if failed is not None and isinstance(failed.call, calls.Open):
                    self._remove_job(job_id)
            case ev.Place():
                raise AssertionError("placement happens only when a job opens")
            case ev.Recover(job_id, worker_id):
                self._recover(self._jobs[job_id], worker_id)
            case ev.Replicate(worker_id, job_id, open_replica, weights):
                for replica_call in records.replica_calls(self._jobs[job_id], open_replica, weights):
                    self._side_call(worker_id, job_id, replica_call)
            case ev.Release(worker_id, job_id):
                self._side_call(worker_id, job_id, calls.Close())
            case ev.JobLost(job_id, error):
                log.warning("job %s lost: %s", job_id, error.message)
                if self._journal is not None:  # a restart forgets it
                    self._journal.closed(job_id)
            case _:
                return False
        return True
