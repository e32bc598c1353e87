"""String tasks: reversing a short lowercase word."""

from __future__ import annotations

import string

import numpy as np

from plexrl.tasks._base import Problem, Task

_LETTERS = np.array(list(string.ascii_lowercase))


class Reverse(Task):
    """``"rev:abcde="`` -> ``"edcba"``: 3 to 7 random lowercase letters."""

    name = "rev"
    max_tokens = 8  # 7 letters, then EOS

    def draw(self, rng: np.random.Generator) -> Problem:
        word = "".join(rng.choice(_LETTERS, size=int(rng.integers(3, 8))))
        return Problem(prompt=f"rev:{word}=", answer=word[::-1])
