"""Multi-turn trajectories, token in / token out: an agent's LLM turns and the tools between them.

An agent's loop::

    traj = job.trajectory(prompt_tokens, max_turns=4, max_tokens=1024, turn_timeout_s=60)
    while (turn := await traj.generate(params)) is not None:
        action = tokenizer.decode(turn.tokens)
        if is_answer(action):
            traj.stop("answered")
            break
        result, ok, seconds = await run_tool(action)  # off the accelerator: other jobs run
        traj.observe(tokenizer.encode(result), ok=ok, latency_s=seconds)
    reward = score(traj)  # a stopped trajectory is scored like any other

Each turn's prompt is the exact token sequence so far (the prompt, every sampled token, every
observation token), so what the trainer sees is what the sampler saw: nothing is decoded and
re-tokenized between turns. A turn records its sampled tokens, their logprobs, the weight version
that sampled them, the sampler's finish reason and how many of its prompt tokens vLLM's prefix
cache served (the KV of earlier turns; the cache is salted by job and weight version, so a new
version recomputes it). Budgets end a trajectory gracefully: the next ``generate`` returns None
and ``stop_reason`` says which budget. ``trajectory_batch`` (``plexrl.rollout``) turns finished
trajectories into one training batch with observation tokens masked out of the loss.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from plexrl.errors import TrajectoryError
from plexrl.protocol.messages import TurnOf
from plexrl.types import SamplingParams

if TYPE_CHECKING:
    from plexrl.client.job import Job

# Why a trajectory stopped. The caller's own reasons (``traj.stop("answered")``) are any other string.
MAX_TURNS, MAX_TOKENS, TURN_TIMEOUT, TIMEOUT = "max_turns", "max_tokens", "turn_timeout", "timeout"
_EMPTY_I32 = np.zeros(0, np.int32)


@dataclass
class Turn:
    """One LLM turn of a trajectory and the observation that followed it."""

    tokens: np.ndarray  # int32: what the sampler sampled
    logprobs: np.ndarray  # float32: the sampler's logprob of each
    weight_version: int  # the weights that sampled it
    finish_reason: str  # the sampler's: "stop" (EOS or a stop token) or "length"
    prompt_tokens: int  # the sequence this turn continued
    cached_tokens: int | None  # of those, served by vLLM's prefix cache (None: a sampler without one)
    observation: np.ndarray = field(default_factory=lambda: _EMPTY_I32)  # int32: appended after it
    ok: bool | None = None  # the tool's outcome, as the caller reported it (None: nothing observed)
    latency_s: float = 0.0  # how long the tool took, as the caller reported it
    tool_calls: int = 0  # observations appended after it (more than one: the tool was called again)
    tool_errors: int = 0  # of those, reported not ok


class Trajectory:
    """Made by ``job.trajectory(...)``; see the module docstring."""

    def __init__(
        self,
        job: Job,
        prompt: np.ndarray,
        name: str = "",
        *,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        turn_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        problems = []
        if prompt.ndim != 1 or len(prompt) == 0:
            problems.append("the prompt must be a non-empty 1-D sequence of token ids")
        if max_turns is not None and max_turns < 1:
            problems.append(f"max_turns={max_turns} must be >= 1 (or None: no limit)")
        if max_tokens is not None and max_tokens <= len(prompt):
            problems.append(f"max_tokens={max_tokens} must exceed the prompt's {len(prompt)} tokens")
        for budget, value in (("turn_timeout_s", turn_timeout_s), ("timeout_s", timeout_s)):
            if value is not None and not value > 0:
                problems.append(f"{budget}={value} must be > 0 seconds (or None: no limit)")
        if problems:
            raise TrajectoryError("invalid trajectory: " + "; ".join(problems))
        self.job = job
        self.prompt = prompt
        self.name = name  # unique within its job: a pooled job's coordinator routes its turns by it
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.turn_timeout_s = turn_timeout_s
        self.timeout_s = timeout_s
        self.turns: list[Turn] = []
        self.stop_reason: str | None = None  # None while it may take another turn
        self._length = len(prompt)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def __repr__(self) -> str:
        return f"Trajectory({len(self.turns)} turns, {self._length} tokens, stop_reason={self.stop_reason!r})"

    @property
    def tokens(self) -> np.ndarray:
        """The whole sequence so far: prompt, then each turn's sampled tokens and observation."""
        parts = [self.prompt]
        for t in self.turns:
            parts += [t.tokens, t.observation]
        return np.concatenate(parts).astype(np.int32, copy=False)

    def __len__(self) -> int:
        return self._length

    @property
    def sampled_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    async def generate(self, params: SamplingParams | None = None, *, priority: int = 0) -> Turn | None:
        """Sample the next turn (one completion continuing ``tokens``); None once the trajectory has
        stopped, with ``stop_reason`` saying why. ``params.max_tokens`` is cut to what
        ``max_tokens`` leaves."""
        params = params or SamplingParams()
        if params.n != 1:
            raise TrajectoryError(f"a trajectory samples one completion per turn (got n={params.n}); "
                                  "start n trajectories for a group")  # fmt: skip
        if self.stop_reason is not None:
            return None
        if self.max_turns is not None and len(self.turns) >= self.max_turns:
            self.stop(MAX_TURNS)
            return None
        budget = params.max_tokens
        if self.max_tokens is not None:
            budget = min(budget, self.max_tokens - self._length)
            if budget < 1:
                self.stop(MAX_TOKENS)
                return None
        timeout, reason = self.turn_timeout_s, TURN_TIMEOUT
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.stop(TIMEOUT)
                return None
            if timeout is None or left < timeout:
                timeout, reason = left, TIMEOUT
        if budget != params.max_tokens:
            params = _with_max_tokens(params, budget)
        prompt = self.tokens
        call = self.job._generate([prompt], params, priority, self._turn_of())
        try:
            async with asyncio.timeout(timeout):
                out = await call
        except TimeoutError:  # the call was cancelled, at the coordinator too
            self.stop(reason)
            return None
        cached = None if out.cached_tokens_P is None else int(out.cached_tokens_P[0])
        turn = Turn(out.tokens[0], out.logprobs[0], out.weight_version, out.finish_reasons[0], len(prompt), cached)
        self.turns.append(turn)
        self._length += len(turn.tokens)
        return turn

    def observe(self, tokens: np.ndarray | list[int], *, ok: bool = True, latency_s: float = 0.0) -> None:
        """Append what a tool returned after the last turn (token ids; masked out of the loss).
        An observation that would pass ``max_tokens`` stops the trajectory instead (``max_tokens``)."""
        obs = np.asarray(tokens, np.int32).reshape(-1)
        if not self.turns:
            raise TrajectoryError("observe() follows a turn: put what comes before the first turn in the prompt")
        if self.stop_reason is not None:
            raise TrajectoryError(f"the trajectory has stopped ({self.stop_reason}): it takes no more observations")
        if self.max_tokens is not None and self._length + len(obs) >= self.max_tokens:
            self.stop(MAX_TOKENS)
            return
        last = self.turns[-1]
        last.observation = np.concatenate([last.observation, obs])
        last.ok = ok if last.ok is None else (last.ok and ok)
        last.latency_s += latency_s
        last.tool_calls += 1
        last.tool_errors += not ok
        self._length += len(obs)

    def _turn_of(self) -> TurnOf:
        """What the coordinator routes the next turn by (Libra's signals at tool boundaries)."""
        return TurnOf(
            trajectory=self.name,
            turn=len(self.turns),
            tool_errors=sum(t.tool_errors for t in self.turns),
            retries=sum(max(0, t.tool_calls - 1) for t in self.turns),
            tokens=self._length,
            token_budget=self.max_tokens or 0,
            tool_s=self.turns[-1].latency_s if self.turns else 0.0,
        )

    def stop(self, reason: str = "done") -> None:
        """End the trajectory (the caller's reason, e.g. "answered"); a budget's reason is kept."""
        if self.stop_reason is None:
            self.stop_reason = reason

    # -- what it cost (the prefix cache, across turns) ----------------------------------------------

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens of turns after the first that the prefix cache served."""
        return sum(t.cached_tokens or 0 for t in self.turns[1:])

    @property
    def reprompted_tokens(self) -> int:
        """Prompt tokens of turns after the first: what the cache could have served."""
        return sum(t.prompt_tokens for t in self.turns[1:])


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return msgspec.structs.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))


def prefix_cache_hit_rate(trajectories: list[Trajectory]) -> float | None:
    """The share of later turns' prompt tokens the prefix cache served (None: no later turns, or a
    sampler without a prefix cache)."""
    if any(t.cached_tokens is None for traj in trajectories for t in traj.turns):
        return None
    total = sum(t.reprompted_tokens for t in trajectories)
    return sum(t.cached_tokens for t in trajectories) / total if total else None
