"""Arithmetic tasks: multi-digit addition and multiplication by one digit, answers in decimal."""

from __future__ import annotations

import numpy as np

from plexrl.tasks._base import Problem, Task


def _number(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
    """A number whose digit count is uniform in ``[min_digits, max_digits]``, then uniform in it."""
    digits = int(rng.integers(min_digits, max_digits + 1))
    return int(rng.integers(10 ** (digits - 1), 10**digits))


class Add(Task):
    """``"123+45="`` -> ``"168"``: two operands of 2 or 3 digits each."""

    name = "add"
    max_tokens = 5  # up to 999+999=1998, then EOS

    def draw(self, rng: np.random.Generator) -> Problem:
        a, b = _number(rng, 2, 3), _number(rng, 2, 3)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


class Mul(Task):
    """``"37*6="`` -> ``"222"``: a 2 or 3 digit number times a digit from 2 to 9."""

    name = "mul"
    max_tokens = 5  # up to 999*9=8991, then EOS

    def draw(self, rng: np.random.Generator) -> Problem:
        a, b = _number(rng, 2, 3), int(rng.integers(2, 10))
        return Problem(prompt=f"{a}*{b}=", answer=str(a * b))
