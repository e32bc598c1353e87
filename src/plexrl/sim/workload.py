"""Workload models: what one RL job asks of an accelerator, step after step, as random draws.

A job is a loop of ``steps`` GRPO steps. A step's rollout is ``turns`` ``generate`` calls (an
agentic rollout: between two turns the job waits on a tool, off the accelerator), then one
``forward_backward``, one ``optim_step`` and one ``sync_weights``. A ``generate`` call decodes a
batch of ``rollouts`` sequences and lasts as long as its longest sequence (the long tail):
``max(lengths) * decode_step_s``. Lengths and tool latencies are lognormal, so both have tails.
All draws come from the job's own seeded generator: a run replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lognormal:
    """A positive random quantity with median ``median`` and log-space spread ``sigma``."""

    median: float
    sigma: float

    def draw(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray:
        return rng.lognormal(np.log(self.median), self.sigma, size)


@dataclass(frozen=True)
class JobModel:
    name: str
    steps: int = 10
    rollouts: int = 64  # sequences per generate call (prompts x group size)
    turns: int = 1  # generate calls per step, a tool call between two of them
    output_tokens: Lognormal = Lognormal(256.0, 0.8)
    decode_step_s: float = 0.02  # one decode step of the whole batch
    tool_latency_s: Lognormal = Lognormal(2.0, 1.0)
    train_s_per_token: float = 2e-5  # forward_backward over the step's tokens
    optim_step_s: float = 0.05
    sync_s: float = 0.05
    state_bytes: int = 0  # trainable + sampler state that must be on the device for its calls

    def generate_s(self, rng: np.random.Generator) -> tuple[float, int]:
        """Seconds of one generate call, and the tokens it produced."""
        lengths = np.ceil(self.output_tokens.draw(rng, self.rollouts))
        return float(lengths.max() * self.decode_step_s), int(lengths.sum())

    def tool_s(self, rng: np.random.Generator) -> float:
        return float(self.tool_latency_s.draw(rng))
