"""The coordinator's scheduler on virtual time: workload models in place of workers and clients.

``Simulation`` feeds the *same* ``Scheduler`` object the coordinator uses the events a real
cluster would produce (workers join, jobs open, calls are submitted and finish, state moves)
and carries out its actions on a virtual clock. Each job runs its ``JobModel`` program, one call
at a time as a GRPO script does; tool waits pass off the accelerator.

A device runs up to ``slots`` calls at once and shares itself between them: all running
generate calls form one decode batch (a decode round advances each by one step and costs the
shared weight reads once per base model plus every call's own part), and the batch and each
other call split the device's time equally. Alone, every call takes exactly its modelled time.
A ``Swap`` moves a job's state at ``swap_bytes_per_s`` beside the running calls (a side stream)
and answers with ``SwapDone``. A ``Tick`` every ``tick_s`` lets waiting jobs hit their
starvation bound. Deterministic for a given seed.

Workers sit on nodes of ``node_devices`` (worker ``i`` is device ``i % node_devices`` of node
``i // node_devices``). A group job (``JobModel.devices`` > 1) is placed by the scheduler on an
aligned block of one node; each of its calls runs on all members at once (the scheduler starts it
only when they all drained and starts nothing else there until it ends), so the simulator runs it
on its leader at the group's modelled cost and counts every member busy and held meanwhile. Its
state moves on every member in parallel, one ``Swap`` each.

Device-hours are what a cluster pays for: a device is held from the first call it runs until
the last call it runs finishes. Under ``dedicated`` that is each job's wall time; when jobs
share devices it is the devices' common span. Per-job accelerator-seconds come from the
scheduler's own ledger (``plexrl.coordinator.accounting``), as in ``plexrl status``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from plexrl.coordinator import events as ev
from plexrl.coordinator import scheduler as sch
from plexrl.names import Role
from plexrl.plan import served_bytes
from plexrl.sim.costs import data_parallel_s
from plexrl.sim.workload import Fork, JobModel, Step, Wait, Work, job_rngs, program
from plexrl.trace import Span

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A simulated worker: its role, bucket and batch limit (``slots`` None: the simulation's);
    ``tp`` devices acting as one (tensor parallelism: each decode round takes ``1/tp`` of its
    time plus ``comm_s`` of all-reduces; other calls ``1/tp``)."""

    role: Role = "both"
    bucket: int = 0
    slots: int | None = None
    tp: int = 1
    comm_s: float = 0.0


@dataclass(slots=True)
class JobResult:
    name: str
    worker: str = ""
    started_s: float = 0.0
    finished_s: float | None = None  # None: did not finish (failed, or the run was cut short)
    accelerator_s: float = 0.0  # its calls' device time (its share when batched) + its transitions
    calls: int = 0
    error: str = ""
    trained_samples: int = 0  # trajectories (pooled) its forward_backward calls trained on
    steps_done_s: list[float] = field(default_factory=list)  # when each of its optimizer steps finished
    members: tuple[str, ...] = ()  # a group job's workers (``worker`` first)

    @property
    def wall_s(self) -> float:
        return (self.finished_s if self.finished_s is not None else float("nan")) - self.started_s


@dataclass(slots=True)
class SimResult:
    policy: str
    jobs: list[JobResult]
    busy_s: dict[str, float]  # per worker: seconds with a call running
    held_s: dict[str, float]  # per worker: first call start to last call end
    end_s: float
    swaps: int = 0
    swap_s: float = 0.0
    timeline: list[Span] = field(default_factory=list)  # each call, as plexrl.trace writes real runs' calls
    role_moves: int = 0  # workers moved between rollout and training
    joins: int = 0  # times rollout workers joined a job's training (``scheduler/elastic.py``)
    weight_pushes: int = 0  # pooled jobs' weights pushed to rollout workers before their turns there
    push_s: float = 0.0  # and their seconds (each turn behind one starts that much later)

    @property
    def trained_samples_per_s(self) -> float:
        return sum(j.trained_samples for j in self.jobs) / self.end_s if self.end_s else 0.0

    @property
    def device_hours(self) -> float:
        return sum(self.held_s.values()) / 3600

    @property
    def busy_fraction(self) -> float:
        held = sum(self.held_s.values())
        return sum(self.busy_s.values()) / held if held else 0.0


@dataclass(slots=True)
class _Runner:
    """A program in progress: a job's own, or one trajectory of a ``Fork`` (``parent`` goes on
    once its ``left`` forked programs have ended)."""

    program: Iterator[Step]
    parent: _Runner | None = None
    left: int = 0


@dataclass(slots=True)
class _SimJob:
    model: JobModel
    runner: _Runner
    result: JobResult


@dataclass(slots=True)
class _Running:
    call_id: int
    job_id: str
    work: Work
    left: float  # decode steps (generate) or seconds (other calls) still to do
    started_s: float
    runner: _Runner | None  # None: a call of the scheduler's own
    members: tuple[str, ...] = ()  # a group call: the members besides the device it is modelled on
    exclusive: bool = False  # the device's generates pause while it runs (``events.Dispatch``)


@dataclass(slots=True)
class _Device:
    running: dict[int, _Running] = field(default_factory=dict)
    since: float = 0.0  # progress of the running calls is settled up to here
    version: int = 0  # bumps whenever the running set changes: stale completion events are ignored
    completing: bool = False  # inside _complete, which reschedules once at its end
    pace: dict[int, float] = field(default_factory=dict)  # rates() since the running set last changed
    busy_s: float = 0.0
    first_s: float | None = None
    last_s: float = 0.0
    tp: int = 1  # devices acting as one
    comm_s: float = 0.0  # a decode round's all-reduces when tp > 1

    def rates(self) -> dict[int, float]:
        """Progress per second of each running call (steps/s for generate, seconds/s otherwise)."""
        if len(self.running) == 1:  # alone: its own modelled pace
            (r,) = self.running.values()
            step_s = (r.work.own_step_s + r.work.shared_step_s) / self.tp + self.comm_s
            if r.work.kind != "generate":
                return {r.call_id: float(self.tp)}
            return {r.call_id: 1.0 / step_s if step_s > 0 else float("inf")}
        gens = [r for r in self.running.values() if r.work.kind == "generate"]
        paused = bool(gens) and any(r.exclusive for r in self.running.values())
        parties = len(self.running) - len(gens) + (1 if gens and not paused else 0)
        rates = {r.call_id: self.tp / parties for r in self.running.values() if r.work.kind != "generate"}
        if paused:
            rates.update({r.call_id: 0.0 for r in gens})
        elif gens:
            shared = {r.work.base or f"#{r.call_id}": r.work.shared_step_s for r in gens}
            round_s = (sum(shared.values()) + sum(r.work.own_step_s for r in gens)) / self.tp + self.comm_s
            for r in gens:
                rates[r.call_id] = 1.0 / (parties * round_s) if round_s > 0 else float("inf")
        return rates


class Simulation:
    def __init__(
        self,
        policy: str,
        workers: int,
        jobs: list[JobModel],
        seed: int = 0,
        *,
        slots: int = 1,
        memory_bytes: float = float("inf"),
        swap_bytes_per_s: float = 25e9,
        tick_s: float = 1.0,
        record_timeline: bool = False,
        worker_specs: list[WorkerSpec] | None = None,
        scheduler: sch.Scheduler | None = None,
        move_s: float = 0.0,
        node_devices: int = 8,
    ) -> None:
        """``worker_specs`` (one per worker; by default ``workers`` of role "both") give roles and
        buckets; ``scheduler`` one configured beyond its policy (buckets, a rebalancer); ``move_s``
        what moving a worker between roles costs once its running calls have ended (sleeping or
        waking its sampler, loading the base for training); ``node_devices`` the workers of a node."""
        self.policy = policy
        self.slots = slots
        self.memory_bytes, self.swap_bytes_per_s, self.tick_s = memory_bytes, swap_bytes_per_s, tick_s
        self.record_timeline = record_timeline
        self._swaps, self._swap_s, self._left = 0, 0.0, 0
        self._timeline: list[Span] = []
        self.scheduler = scheduler or sch.Scheduler(policy)
        self.move_s = move_s
        self._role_moves = 0
        self._joins = 0
        self._pushes: dict[tuple[str, str], float] = {}  # (rollout worker, job) -> a push its next turn waits for
        self._weight_pushes = 0
        self._push_s = 0.0
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []  # (time, tie-break, action)
        self._seq = itertools.count()
        self._call_ids = itertools.count(1)
        self._specs = {f"w{i}": spec for i, spec in enumerate(worker_specs or [WorkerSpec()] * workers)}
        self.node_devices = node_devices
        self._devices = {w: _Device(tp=spec.tp, comm_s=spec.comm_s) for w, spec in self._specs.items()}
        self._jobs: dict[str, _SimJob] = {}
        self._calls: dict[int, tuple[str, Work, _Runner | None]] = {}  # submitted, not yet dispatched
        for i, (model, rng) in enumerate(zip(jobs, job_rngs(seed, len(jobs)), strict=True)):
            job_id = f"{model.name}-{i}"
            runner = _Runner(program(model, rng))
            self._jobs[job_id] = _SimJob(model, runner, JobResult(model.name))

    def run(self, until_s: float = float("inf")) -> SimResult:
        for i, (w, spec) in enumerate(self._specs.items()):
            slots = spec.slots or self.slots
            node, index = divmod(i, self.node_devices)
            joined = ev.WorkerJoined(w, slots, memory_bytes=self.memory_bytes, swap_bytes_per_s=self.swap_bytes_per_s,
                                     role=spec.role, bucket=spec.bucket, node=f"n{node}", index=index,
                                     devices=spec.tp)  # fmt: skip
            self._handle(joined)
        self._left = len(self._jobs)
        for job_id, job in self._jobs.items():
            self._at(job.model.arrival_s, functools.partial(self._open, job_id))
        if self.memory_bytes != float("inf") or self.scheduler.rebalancer is not None:
            self._at(self.tick_s, self._tick)
        while self._events and self._events[0][0] <= until_s:
            self.now, _, fire = heapq.heappop(self._events)
            fire()
        ledger = self.scheduler.ledger
        for job_id, job in self._jobs.items():
            job.result.accelerator_s = ledger.accelerator_s(job_id, self.now)
        return SimResult(
            policy=self.policy,
            jobs=[j.result for j in self._jobs.values()],
            busy_s={w: d.busy_s * d.tp for w, d in self._devices.items()},  # per device, a TP group's devices
            held_s={w: (d.last_s - d.first_s) * d.tp for w, d in self._devices.items() if d.first_s is not None},
            end_s=self.now,
            swaps=self._swaps,
            swap_s=self._swap_s,
            timeline=self._timeline,
            role_moves=self._role_moves,
            joins=self._joins,
            weight_pushes=self._weight_pushes,
            push_s=self._push_s,
        )

    def _open(self, job_id: str) -> None:
        job = self._jobs[job_id]
        model = job.model
        opened = ev.JobOpened(job_id, model.state_bytes, base=model.base, disaggregated=model.disaggregated,
                              pooled=model.pooled, devices=model.devices)  # fmt: skip
        self._handle(opened)
        if job.result.error:
            self._left -= 1

    def _tick(self) -> None:
        self._handle(ev.Tick())
        if self._left:
            self._at(self.now + self.tick_s, self._tick)

    # -- the scheduler seam, as in the coordinator's server --------------------------------------

    def _handle(self, event: ev.Event) -> None:
        for action in self.scheduler.handle(event, self.now):
            match action:
                case ev.Place(job_id, worker_id, _, members):
                    job = self._jobs[job_id]
                    job.result.worker, job.result.started_s, job.result.members = worker_id, self.now, members
                    if job.model.recoverable:  # as its open's result tells the coordinator
                        self._handle(ev.JobSized(job_id, job.model.state_bytes, snapshots=True))
                    self._advance(job_id, job.runner)
                case ev.Replicate(worker_id, job_id, _, weights, weight_bytes) if weights:
                    seconds = weight_bytes / self.swap_bytes_per_s
                    self._pushes[(worker_id, job_id)] = seconds
                    self._weight_pushes += 1
                    self._push_s += seconds
                case ev.Dispatch(call_id, worker_id, _, exclusive, own):
                    if (
                        own is not None
                    ):  # the scheduler's own call: a follow-on, or a restore (a recovery's or a join's)
                        self._calls[call_id] = (own.job_id, self._own_work(own), None)
                        self._joins += own.join
                    push_s = self._pushes.pop((worker_id, self._calls[call_id][0]), 0.0)
                    start = functools.partial(self._start, call_id, worker_id, exclusive)
                    if push_s:  # the turn runs once the weights it samples have arrived
                        self._at(self.now + push_s, start)
                    else:
                        start()
                case ev.MoveWorker(worker_id, role):  # drained: it switches (``move_s``)
                    self._role_moves += 1
                    switched = ev.WorkerRole(worker_id, role, seconds=self.move_s)
                    self._at(self.now + self.move_s, functools.partial(self._handle, switched))
                case ev.Fail(job_id, _, error):
                    self._jobs[job_id].result.error = error.message
                case ev.Swap(job_id, worker_id, _, state_bytes):
                    seconds = state_bytes / self.swap_bytes_per_s
                    self._swaps += 1
                    self._swap_s += seconds
                    done = ev.SwapDone(job_id, seconds, worker_id=worker_id)
                    self._at(self.now + seconds, functools.partial(self._handle, done))
                case ev.MoveEngines(worker_id, _, _, engine_bytes):  # a sleep or wake: their memory crosses once
                    seconds = engine_bytes / self.swap_bytes_per_s
                    self._swap_s += seconds
                    moved = ev.EnginesMoved(worker_id, seconds)
                    self._at(self.now + seconds, functools.partial(self._handle, moved))

    def _own_work(self, own: ev.OwnCall) -> Work:
        """What a call of the scheduler's own costs: weights crossing to a sampler worker (a
        follow-on's ``set_weights``) or a job's state rebuilt (``restore``), at the swap bandwidth;
        a join's restore also costs a move between roles (``move_s``: its process group starts, the
        helper leaves its sampling); a replica's ``open`` or ``close`` costs nothing here (as the
        job's own do not)."""
        state = self._jobs[own.job_id].model.state_bytes
        moved = {"set_weights": served_bytes(state), "restore": state}.get(own.kind, 0)
        return Work(own.kind, seconds=moved / self.swap_bytes_per_s + (self.move_s if own.join else 0.0))

    def _at(self, t: float, fire: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fire))

    def _advance(self, job_id: str, runner: _Runner) -> None:
        """Run one of the job's programs up to its next call (tool waits pass on the virtual clock)."""
        job = self._jobs[job_id]
        step = next(runner.program, None)
        if step is None:
            if runner.parent is not None:  # a forked trajectory ended
                runner.parent.left -= 1
                if not runner.parent.left:
                    self._advance(job_id, runner.parent)
                return
            job.result.finished_s = self.now
            self._left -= 1
            self._handle(ev.JobClosed(job_id))
            return
        if isinstance(step, Wait):
            self._at(self.now + step.seconds, lambda: self._advance(job_id, runner))
            return
        if isinstance(step, Fork):
            runner.left = len(step.programs)
            if not step.programs:
                self._advance(job_id, runner)
            for forked in step.programs:
                self._advance(job_id, _Runner(forked, parent=runner))
            return
        call_id = next(self._call_ids)
        self._calls[call_id] = (job_id, step, runner)
        self._handle(ev.CallSubmitted(call_id, job_id, step.kind, trajectory=step.trajectory, signals=step.signals))

    # -- devices --------------------------------------------------------------------------------

    def _start(self, call_id: int, worker_id: str, exclusive: bool = False) -> None:
        job_id, work, runner = self._calls.pop(call_id)
        device = self._devices[worker_id]
        self._settle(device)
        if device.first_s is None:
            device.first_s = self.now
        model = self._jobs[job_id].model
        members = self.scheduler.members(call_id)[1:]  # a gang's call: held by it on every member
        left = float(work.steps) if work.kind == "generate" else work.seconds
        if members and model.devices == 1:  # rollout workers joined its training: data parallel
            left = data_parallel_s(work.kind, work.seconds, model.grad_bytes, 1 + len(members))
        for member in members:  # held by the gang: nothing else runs there until the call ends
            other = self._devices[member]
            other.first_s = self.now if other.first_s is None else other.first_s
        device.running[call_id] = _Running(call_id, job_id, work, left, self.now, runner, members, exclusive)
        result = self._jobs[job_id].result
        result.calls += 1
        if not device.completing:
            self._reschedule(worker_id, device)

    def _settle(self, device: _Device) -> None:
        dt = self.now - device.since
        if dt > 0 and device.running:
            device.busy_s += dt
            for call_id, rate in device.pace.items():
                device.running[call_id].left -= rate * dt
        device.since = self.now

    def _reschedule(self, worker_id: str, device: _Device) -> None:
        device.version += 1
        device.pace = rates = device.rates() if device.running else {}
        if not rates:
            return
        soonest = min(max(0.0, r.left) / rates[r.call_id] for r in device.running.values() if rates[r.call_id] > 0)
        self._at(self.now + soonest, functools.partial(self._complete, worker_id, device.version))

    def _complete(self, worker_id: str, version: int) -> None:
        device = self._devices[worker_id]
        if version != device.version:
            return  # the running set changed since this completion was scheduled
        self._settle(device)
        done = [r for r in device.running.values() if r.left <= _EPS * max(1.0, r.work.alone_s)]
        if not done:  # rounding: the soonest call is a hair short of done
            moving = [r for r in device.running.values() if device.pace.get(r.call_id, 0.0) > 0]
            done = [min(moving, key=lambda r: r.left / device.pace[r.call_id])]
        for r in done:
            del device.running[r.call_id]
        device.last_s = self.now
        device.version += 1
        device.completing = True
        for r in done:
            for member in r.members:
                other = self._devices[member]
                other.busy_s += self.now - r.started_s
                other.last_s = self.now
            if self.record_timeline:
                for device_id in (worker_id, *r.members):
                    self._timeline.append(Span(device_id, r.job_id, r.work.kind, r.started_s, self.now))
            self._handle(ev.CallFinished(r.call_id))
            result = self._jobs[r.job_id].result
            result.trained_samples += r.work.samples
            if r.work.kind == "optim_step":
                result.steps_done_s.append(self.now)
            if r.runner is not None:
                self._advance(r.job_id, r.runner)
        device.completing = False
        self._reschedule(worker_id, device)
