"""Workload models: what one RL job asks of an accelerator, step after step, as random draws.

A job is a loop of ``steps`` GRPO steps. A step's rollout is ``turns`` rounds of a ``generate``
call followed by a tool call (off the accelerator; the last one is the verifier scoring the
answers), then one ``forward_backward``, one ``optim_step`` and one ``sync_weights``. A
``generate`` call decodes ``rollouts`` sequences and takes as many decode steps as its longest
sequence (the long tail). Alone on a device, a decode step takes ``decode_step_s``; the part
``shared_step_fraction`` of it is reading the base model's weights, which generate calls of
jobs on the same base share when a device batches them (multi-LoRA sampling). Lengths and tool
latencies are lognormal, so both have tails. All draws come from the job's own seeded
generator: a run replays exactly.

A ``pooled`` job is an agent whose trajectories are scheduled one by one (Libra): a step's
rollout is ``rollouts`` trajectories running at once (``Fork``), each ``turns`` turns of one
sequence, its tool call after each; a tool call fails with probability ``tool_error_p`` and the
agent retries it (one more turn, up to ``max_retries``). With ``difficulty_sigma``, each
trajectory draws a hardness that scales all its turns' lengths and its tool-error chance (hard
problems are long and error-prone throughout: the premise of routing by what a trajectory did). Each turn carries its trajectory's
signals so far (``TurnSignals``), as ``job.trajectory()`` sends them. A turn's decode step costs
``decode_step_s`` (the batch-of-one cost: ``shared_step_fraction`` of it the weight read that
batched turns share) plus ``kv_step_s_per_token`` times its context so far.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from plexrl.coordinator.events import TurnSignals
from plexrl.names import CallKind

NO_SIGNALS = TurnSignals()


@dataclass(frozen=True, slots=True)
class Lognormal:
    """A positive random quantity with median ``median`` and log-space spread ``sigma``."""

    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> np.ndarray:
        return rng.lognormal(np.log(self.median), self.sigma, size)

    @classmethod
    def fit(cls, samples: Iterable[float]) -> Lognormal:
        """The lognormal of ``samples``: the median and spread of their logarithms (a sample of 0,
        such as a turn that sampled nothing, has none and is left out)."""
        logs = _logs(samples)
        return cls(float(np.exp(logs.mean())), float(logs.std()))


def _logs(samples: Iterable[float]) -> np.ndarray:
    """The logarithms of the positive ``samples``."""
    values = np.asarray(list(samples), dtype=np.float64)
    return np.log(values[values > 0])


def hardness_sigma(turn_lengths: Iterable[Iterable[int]]) -> float:
    """The spread of a per-trajectory hardness (``JobModel.difficulty_sigma``) in trajectories'
    turn lengths: the variance of their mean log length beyond what their turns' own spread
    explains (one-way random effects, trajectories of two or more turns that sampled tokens)."""
    logs = [_logs(t) for t in turn_lengths]
    logs = [t for t in logs if len(t) >= 2]
    if len(logs) < 2:
        return 0.0
    within = float(np.mean([t.var(ddof=1) for t in logs]))
    between = float(np.var([t.mean() for t in logs], ddof=1))
    return float(np.sqrt(max(0.0, between - within * float(np.mean([1 / len(t) for t in logs])))))


@dataclass(frozen=True, slots=True)
class JobModel:
    name: str
    steps: int = 10
    rollouts: int = 64  # sequences per generate call (prompts x group size)
    turns: int = 1  # generate calls per step, each followed by a tool call
    output_tokens: Lognormal = Lognormal(256.0, 0.8)
    decode_step_s: float = 0.02  # one decode step of the whole batch, alone on the device
    shared_step_fraction: float = 0.0  # of a decode step: reading weights that same-base batches share
    tool_latency_s: Lognormal = Lognormal(2.0, 1.0)
    train_s_per_token: float = 2e-5  # forward_backward over the step's tokens
    optim_step_s: float = 0.05
    sync_s: float = 0.05
    state_bytes: int = 0  # trainable + sampler state that must be on the device for its calls
    base: str = ""  # the base model: generate calls of jobs on one base batch together
    arrival_s: float = 0.0  # when the job opens
    disaggregated: bool = False  # its generates run on a sampler worker of their own (rollout + trainer devices)
    pooled: bool = False  # an agent whose turns run on the rollout workers, trajectory by trajectory
    prompt_tokens: int = 512  # pooled: a trajectory's first context
    observation_tokens: int = 128  # pooled: what each tool result adds to the context
    kv_step_s_per_token: float = 0.0  # pooled: a turn's decode step cost per token of its context
    tool_error_p: float = 0.0  # pooled: a tool call fails and the agent retries it
    max_retries: int = 3  # pooled: retries per trajectory, at most
    difficulty_sigma: float = (
        0.0  # pooled: a trajectory's hardness, Lognormal(1, this), scales its turns' lengths and its tool errors
    )
    devices: int = 1  # a worker group of this many (FSDP trainer, TP sampler): its costs above are the group's,
    # its ``state_bytes`` each member's shard (``sim/costs.py``: ``group_job``)
    # Its snapshots are kept (the coordinator's --snapshot-max-bytes holds them): it survives a lost worker,
    # and idle rollout workers may join its training (``scheduler/elastic.py``; ``costs.data_parallel_s``).
    recoverable: bool = False
    grad_bytes: int = 0  # its trained parameters' gradients: what a data-parallel optim_step all-reduces

    def max_turns_tokens(self) -> int:
        """A pooled trajectory's token budget beyond its prompt: its turns at the length p99."""
        p99 = self.output_tokens.median * float(np.exp(2.33 * self.output_tokens.sigma))
        return int((self.turns + self.max_retries) * (p99 + self.observation_tokens))

    def draw_step(self, rng: np.random.Generator) -> tuple[list[int], int, list[float]]:
        """One step's draws: decode steps of each turn's generate call (its longest sequence),
        the tokens the step produced, and each turn's tool latency."""
        lengths = np.ceil(self.output_tokens.draw(rng, (self.turns, self.rollouts)))
        tools = self.tool_latency_s.draw(rng, self.turns)
        return lengths.max(axis=1).astype(int).tolist(), int(lengths.sum()), tools.tolist()


@dataclass(frozen=True, slots=True)
class Work:
    """One call of a job's program: ``steps`` decode steps (generate) or ``seconds`` alone on a device."""

    kind: CallKind
    seconds: float = 0.0
    steps: int = 0
    own_step_s: float = 0.0  # generate: the part of a decode step that is this call's alone
    shared_step_s: float = 0.0  # generate: the part shared with same-base calls batched with it
    base: str = ""
    trajectory: str = ""  # a pooled job's turn: its trajectory, and what it showed so far
    signals: TurnSignals = NO_SIGNALS
    samples: int = 0  # forward_backward: the trajectories it trains on

    @property
    def alone_s(self) -> float:
        return self.steps * (self.own_step_s + self.shared_step_s) if self.kind == "generate" else self.seconds


@dataclass(frozen=True, slots=True)
class Wait:
    """A tool call: time passing off the accelerator."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Fork:
    """Programs that run at once (a step's trajectories); the job goes on when all have ended."""

    programs: list[Iterator[Work | Wait | Fork]] = field(default_factory=list)


Step = Work | Wait | Fork


def program(model: JobModel, rng: np.random.Generator) -> Iterator[Step]:
    """The job's calls and tool waits, in order."""
    if model.pooled:
        yield from _agent(model, rng)
        return
    shared = model.decode_step_s * model.shared_step_fraction
    own = model.decode_step_s - shared
    for _ in range(model.steps):
        steps, tokens, tools = model.draw_step(rng)
        for turn_steps, tool_s in zip(steps, tools, strict=True):
            yield Work("generate", steps=turn_steps, own_step_s=own, shared_step_s=shared, base=model.base)
            yield Wait(tool_s)
        yield Work("forward_backward", seconds=tokens * model.train_s_per_token)
        yield Work("optim_step", seconds=model.optim_step_s)
        yield Work("sync_weights", seconds=model.sync_s)


def _agent(model: JobModel, rng: np.random.Generator) -> Iterator[Step]:
    """A pooled job: each step forks its trajectories, then trains on all of them."""
    for step in range(model.steps):
        trajectories = [_trajectory(model, rng, f"s{step}-{i}") for i in range(model.rollouts)]
        tokens = sum(t[1] for t in trajectories)
        yield Fork([t[0] for t in trajectories])
        yield Work("forward_backward", seconds=tokens * model.train_s_per_token, samples=model.rollouts)
        yield Work("optim_step", seconds=model.optim_step_s)
        yield Work("sync_weights", seconds=model.sync_s)


def _trajectory(model: JobModel, rng: np.random.Generator, name: str) -> tuple[Iterator[Step], int]:
    """One trajectory's turns and tool calls (drawn now, so a run replays whatever the schedule),
    and its tokens."""
    shared = model.decode_step_s * model.shared_step_fraction
    own = model.decode_step_s - shared
    budget = model.prompt_tokens + model.max_turns_tokens()
    steps: list[Step] = []
    context, sampled, errors, turn = model.prompt_tokens, 0, 0, 0
    # A hard problem is hard throughout: longer turns and more failed tool calls (what makes a
    # trajectory's past a signal of its future; 0: every turn drawn alike).
    hardness = float(rng.lognormal(0.0, model.difficulty_sigma)) if model.difficulty_sigma else 1.0
    error_p = min(0.9, model.tool_error_p * hardness)
    while turn < model.turns + errors:
        length = int(np.ceil(hardness * model.output_tokens.draw(rng)))
        signals = TurnSignals(turn=turn, tool_errors=errors, tokens=context, token_budget=budget)
        # Its context grows while it decodes: the mean context over the turn's steps.
        per_step = own + model.kv_step_s_per_token * (context + length / 2)
        steps.append(Work("generate", steps=length, own_step_s=per_step, shared_step_s=shared, base=model.base,
                          trajectory=name, signals=signals))  # fmt: skip
        context += length + model.observation_tokens
        sampled += length
        failed = errors < model.max_retries and rng.random() < error_p
        errors += failed
        steps.append(Wait(float(model.tool_latency_s.draw(rng))))
        turn += 1
    return iter(steps), context


def job_rngs(seed: int, jobs: int) -> list[np.random.Generator]:
    """Each job's own generator in a run of ``seed`` (``Simulation`` draws every job's program from
    these, so anything that replays the draws gets the same work)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(jobs)]


def critical_path_s(steps: Iterable[Step], tp: int = 1, comm_s: float = 0.0) -> float:
    """How long ``steps`` take if every call runs alone the moment it may, its generates on a
    ``tp``-device tensor-parallel worker (each decode step ``1/tp`` of its batch-of-one cost plus
    ``comm_s``), its other calls on one device, its forked trajectories side by side: a lower bound
    on the job's time under any schedule on such workers (its dependency chain)."""
    total = 0.0
    for step in steps:
        if isinstance(step, Fork):
            total += max((critical_path_s(p, tp, comm_s) for p in step.programs), default=0.0)
        elif isinstance(step, Wait):
            total += step.seconds
        elif step.kind == "generate":
            total += step.steps * ((step.own_step_s + step.shared_step_s) / tp + comm_s)
        else:
            total += step.seconds
    return total
