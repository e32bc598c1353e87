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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Lognormal:
    """A positive random quantity with median ``median`` and log-space spread ``sigma``."""

    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> np.ndarray:
        return rng.lognormal(np.log(self.median), self.sigma, size)


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

    def draw_step(self, rng: np.random.Generator) -> tuple[list[int], int, list[float]]:
        """One step's draws: decode steps of each turn's generate call (its longest sequence),
        the tokens the step produced, and each turn's tool latency."""
        lengths = np.ceil(self.output_tokens.draw(rng, (self.turns, self.rollouts)))
        tools = self.tool_latency_s.draw(rng, self.turns)
        return lengths.max(axis=1).astype(int).tolist(), int(lengths.sum()), tools.tolist()


@dataclass(frozen=True, slots=True)
class Work:
    """One call of a job's program: ``steps`` decode steps (generate) or ``seconds`` alone on a device."""

    kind: str
    seconds: float = 0.0
    steps: int = 0
    own_step_s: float = 0.0  # generate: the part of a decode step that is this call's alone
    shared_step_s: float = 0.0  # generate: the part shared with same-base calls batched with it
    base: str = ""

    @property
    def alone_s(self) -> float:
        return self.steps * (self.own_step_s + self.shared_step_s) if self.kind == "generate" else self.seconds


@dataclass(frozen=True, slots=True)
class Wait:
    """A tool call: time passing off the accelerator."""

    seconds: float


def program(model: JobModel, rng: np.random.Generator) -> Iterator[Work | Wait]:
    """The job's calls and tool waits, in order."""
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
