"""What a verifiable task is: problems with one right answer, a training sampler, a held-out set.

The problem space is split once by a stable hash of the prompt: a prompt is held out iff
``crc32(prompt) % 10 == 0``. :meth:`Task.sample` never returns a held-out prompt and
:meth:`Task.eval_set` returns only held-out ones, so evaluation never sees a training problem.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from plexrl.models.tokenizer import CharTokenizer
from plexrl.text import Renderer
from plexrl.types import SamplingParams

if TYPE_CHECKING:
    from plexrl.protocol.calls import Generated

EVAL_SIZE = 200


class Problem(msgspec.Struct, frozen=True):
    prompt: str  # what the model is given after BOS, e.g. "123+45="
    answer: str  # the reference completion, e.g. "168": what pretraining teaches, and it earns reward 1.0


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the evaluation side of the split (about one prompt in ten)."""
    return zlib.crc32(prompt.encode()) % 10 == 0


class Task(ABC):
    """A family of problems: subclasses name it and say how to draw one problem at random."""

    name: str
    max_tokens: int  # new tokens that any reference answer and its EOS fit in (a sampling budget)
    # A multi-turn task (an agent's): each model turn ends with ``turn_end``, after which
    # ``respond`` gives the environment's observation, for at most ``max_turns`` turns.
    turn_end: str | None = None
    max_turns: int = 1
    max_turn_tokens: int | None = None  # new tokens one turn may take (None: the whole budget)

    @abstractmethod
    def draw(self, rng: np.random.Generator) -> Problem:
        """One problem from the whole space, held-out ones included."""

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        """``n`` training problems (repeats possible, none held out); deterministic given ``rng``."""
        problems: list[Problem] = []
        while len(problems) < n:
            problem = self.draw(rng)
            if not self.held_out(problem):
                problems.append(problem)
        return problems

    def eval_set(self) -> list[Problem]:
        """The fixed held-out set: :data:`EVAL_SIZE` distinct problems, the same on every call."""
        rng = np.random.default_rng(zlib.crc32(f"eval:{self.name}".encode()))
        problems: dict[str, Problem] = {}
        while len(problems) < EVAL_SIZE:
            problem = self.draw(rng)
            if self.held_out(problem):
                problems.setdefault(problem.prompt, problem)
        return list(problems.values())

    def held_out(self, problem: Problem) -> bool:
        """Whether ``problem`` is on the evaluation side of the split (by default: its prompt's hash)."""
        return is_held_out(problem.prompt)

    def segments(self, problem: Problem) -> list[tuple[str, bool]]:
        """The reference completion as ``(text, learned)`` pieces. Pretraining puts its loss on the
        learned pieces only; a tool-using format marks the observations it is given as not learned."""
        return [(problem.answer, True)]

    def respond(self, problem: Problem, response: str) -> str | None:
        """The environment's observation after a turn ending in ``turn_end`` (``response``: the
        whole response so far, observations included), or None when the trajectory is over."""
        return None

    def observation_ok(self, observation: str) -> bool:
        """Whether the tool call behind ``observation`` succeeded (``Turn.ok``; a scheduler's signal)."""
        return True

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 iff the completion (its text without special tokens: ``Renderer.text``), stripped of
        whitespace, is exactly the answer (a task whose answer is a worked solution checks only its
        final result)."""
        return 1.0 if completion.strip() == problem.answer else 0.0


class _Generates(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Awaitable[Generated]: ...


async def held_out_reward(job: _Generates, task: Task, max_tokens: int, renderer: Renderer | None = None) -> float:
    """Mean reward of ``job``'s greedy answers on ``task``'s held-out problems (how the demo and
    the benchmarks say a job learned); ``renderer``: the model's (default: the shipped tokenizer's)."""
    r = renderer or Renderer(CharTokenizer())
    problems = task.eval_set()
    out = await job.generate([r.prompt(p.prompt) for p in problems], r.turn(max_tokens=max_tokens, temperature=0.0))
    return float(np.mean([task.score(problems[s.prompt_index], r.text(s.tokens)) for s in out.samples]))
