"""A chat-formatted task: addition as the Tinker cookbook's ``arithmetic`` environment asks it.

The prompt is exactly what ``tinker_cookbook``'s ``role_colon`` renderer builds for
``recipes.math_rl`` (``env=arithmetic``): its one-shot example, the question, then the assistant's
header. The reference reply ends with the renderer's stop sequence, ``"\\n\\nUser:"``, as the
cookbook's format reward asks. It is what ``tiny-arith-chat`` is pretrained on
(``python -m plexrl.models.pretrain --init ... --tasks chat``), so that a cookbook recipe run
through ``plexrl tinker`` starts from a partly competent model.
"""

from __future__ import annotations

import numpy as np

from plexrl.tasks._base import Problem, Task

STOP = "\n\nUser:"  # the role_colon renderer's stop sequence
EXAMPLE = "User: What is 4 + 5?\n\nAssistant: 9\n\n"  # arithmetic_env's one-shot prefix, rendered


class ChatAdd(Task):
    """``"User: What is 4 + 5?\\n\\nAssistant: 9\\n\\nUser: What is 37 + 12?\\n\\nAssistant:"`` ->
    ``" 49\\n\\nUser:"``: operands 0 to 100, as the cookbook draws them."""

    name = "chat"
    max_tokens = 12  # " 200\n\nUser:" then EOS

    def draw(self, rng: np.random.Generator) -> Problem:
        x, y = int(rng.integers(0, 101)), int(rng.integers(0, 101))
        return Problem(prompt=f"{EXAMPLE}User: What is {x} + {y}?\n\nAssistant:", answer=f" {x + y}{STOP}")

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 iff the reply, stripped of whitespace, is the sum and the stop sequence."""
        return 1.0 if completion.strip() == problem.answer.strip() else 0.0
