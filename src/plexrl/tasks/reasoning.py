"""A reasoning task with a long tail: add up k numbers, one written-out addition at a time.

``"sum:12+7+45+3="`` -> ``"12+7=19,19+45=64,64+3=67>67"``. The solution carries the running
total through every step and ends with ``>`` and the total; only that final number is checked,
as an RLVR verifier checks a math answer. The count of numbers k is heavy-tailed
(2 + floor(Lognormal(median 2.5, sigma 1)), at most :data:`MAX_TERMS`), so solutions run from
about ten tokens to several hundred: most problems are short and a few are very long, which is
what makes a real rollout's makespan a long tail. Each step is an ``add`` problem on the two
numbers just before it, so short chains come easily and every further step is one more chance
to slip: accuracy falls with k.
"""

from __future__ import annotations

import numpy as np

from plexrl.tasks._base import Problem, Task

MAX_TERMS = 32
ANSWER_MARK = ">"  # what precedes the final answer in a solution


def worked_sum(terms: list[int]) -> str:
    """The step-by-step solution: ``a+b=c`` per addition (c the running total), then ``>total``."""
    total, steps = terms[0], []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    return ",".join(steps) + f"{ANSWER_MARK}{total}"


def final_answer(completion: str) -> str | None:
    """The number after the solution's last ``>``, or None when there is none."""
    if ANSWER_MARK not in completion:
        return None
    return completion.rsplit(ANSWER_MARK, 1)[1].strip()


class ChainSum(Task):
    """``"sum:12+7+45+3="`` -> a worked solution ending ``>67``; reward 1 iff the final total is right."""

    name = "sum"
    max_tokens = 400  # the longest solution of MAX_TERMS two-digit numbers (about 380 tokens) plus EOS

    def draw(self, rng: np.random.Generator) -> Problem:
        k = min(MAX_TERMS, 2 + int(rng.lognormal(np.log(2.5), 1.0)))
        terms = [int(t) for t in rng.integers(1, 100, size=k)]
        return Problem(prompt="sum:" + "+".join(map(str, terms)) + "=", answer=worked_sum(terms))

    def score(self, problem: Problem, completion: str) -> float:
        answer = final_answer(completion)
        return 1.0 if answer is not None and answer == final_answer(problem.answer) else 0.0
