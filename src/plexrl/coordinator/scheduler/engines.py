"""A worker's vLLM engines: asleep while its training needs their memory, awake to sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plexrl.coordinator.events import MoveEngines
from plexrl.coordinator.scheduler.state import (
    ASLEEP,
    AWAKE,
    TO_SLEEP,
    TO_WAKE,
    ScheduledCall,
    ScheduledJob,
    ScheduledWorker,
    Tables,
)
from plexrl.names import EngineState
from plexrl.plan import TRAINING_KINDS, sleep_level

Entries = list[tuple[ScheduledJob, list[ScheduledCall]]]  # a dispatch pass's jobs and their startable calls


@dataclass(slots=True)
class EngineGate:
    """One dispatch pass's view of a worker's engines: settled in a state, draining the calls that
    need it (a switch is due), and the state a call needs them in otherwise (its job: ``want_for``)."""

    settled: bool
    draining: bool
    want: EngineState | Literal[""]
    want_for: str

    def lets_start(self, worker: ScheduledWorker, job: ScheduledJob, need: EngineState | Literal[""]) -> bool:
        """A call needing the engines in ``need`` may start now; the first one needing the other
        state than theirs is noted as what they should switch to."""
        if need and (not self.settled or need != worker.engines or self.draining):
            if self.settled and need != worker.engines and not self.want:
                self.want, self.want_for = need, job.job_id
            return False
        return True


class Engines:
    """When each worker's engines switch, and what their switches cost."""

    def __init__(self, t: Tables) -> None:
        self.t = t

    def gate(self, worker: ScheduledWorker, entries: Entries, now: float) -> EngineGate:
        """Its engines switch state when a call needs them in the other one: calls needing the state
        they are in stop starting once they have been in it as long as a switch round costs."""
        want, want_for = self._wanted(worker, entries)
        draining = bool(want) and now - worker.engines_since >= worker.switch_s
        return EngineGate(worker.engines in (AWAKE, ASLEEP), draining, want, want_for)

    def switch_due(self, worker: ScheduledWorker, gate: EngineGate, now: float) -> list[MoveEngines]:
        """After a dispatch pass: switch the engines to the state the gate wants, once they have
        been in theirs a switch round's time and no running call holds them."""
        worker.wanted, worker.wanted_for = gate.want, gate.want_for
        if gate.want and now - worker.engines_since >= worker.switch_s and not self._held(worker):
            return [self._move(worker, gate.want)]
        return []

    def need(self, worker: ScheduledWorker, call: ScheduledCall) -> EngineState | Literal[""]:
        """The state ``call`` needs ``worker``'s engines in ("": either). A training call needs them
        asleep when the plan says it does not fit beside them; a save needs nothing of them; every
        other call samples or changes what they serve, so it needs them awake."""
        if call.kind in TRAINING_KINDS:
            return ASLEEP if worker.must_sleep() else ""
        return "" if call.kind == "save" or worker.plan is None else AWAKE

    def moved(self, worker_id: str, seconds: float, ok: bool, now: float) -> str | None:
        """A switch of ``worker_id``'s engines is done: charged to the job whose call asked for it,
        like a state swap. A failed one leaves them awake, and they are not put to sleep again."""
        worker = self.t.registered.get(worker_id)
        if worker is None or worker.engines not in (TO_SLEEP, TO_WAKE):
            return None
        slept = worker.engines == TO_SLEEP
        worker.engines = ASLEEP if slept and ok else AWAKE
        worker.sleep_failed |= not ok
        worker.engines_since = now
        if slept:
            worker.sleep_s = seconds
        else:
            worker.wake_s = seconds
        self.t.ledger.swapped(worker.engines_for, worker.fixed_bytes("engine"), seconds)
        worker.engines_for = ""
        return worker_id

    def _wanted(self, worker: ScheduledWorker, entries: Entries) -> tuple[EngineState | Literal[""], str]:
        """The other state than theirs that the first startable call (in rank order) needing one
        needs ``worker``'s engines in, and its job; ("", "") if none."""
        if worker.engines not in (AWAKE, ASLEEP):
            return "", ""
        for job, startable in entries:
            first = startable[0]
            if job.members or worker.gang or (job.rebuilding and first.kind != "restore"):
                continue
            if self.t.waits_for_move(job, first, worker):
                continue
            for call in startable:
                need = self.need(worker, call)
                if need and need != worker.engines:
                    return need, job.job_id
        return "", ""

    def _held(self, worker: ScheduledWorker) -> bool:
        """A running call keeps ``worker``'s engines as they are: while awake, one that samples or
        changes what they serve; while asleep, a training call (its activations use their memory)."""
        for call_id in worker.running:
            call = self.t.calls.get(call_id)
            if call is None:
                continue
            training = call.kind in TRAINING_KINDS
            if (worker.engines == ASLEEP and training) or (
                worker.engines == AWAKE and not training and call.kind != "save"
            ):
                return True
        return False

    def _move(self, worker: ScheduledWorker, to: EngineState) -> MoveEngines:
        assert worker.plan is not None  # only a planned worker's training asks for a sleep
        engines = worker.fixed_bytes("engine")
        if to == ASLEEP:
            worker.engines_level = sleep_level(worker.plan, engines)
        worker.engines = TO_SLEEP if to == ASLEEP else TO_WAKE
        worker.engines_for, worker.wanted, worker.wanted_for = worker.wanted_for, "", ""
        return MoveEngines(worker.worker_id, to, worker.engines_level, engines, worker.engines_for)
