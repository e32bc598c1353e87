"""Verifiable tasks for RL on plexrl's shipped model: prompts, exact answers, 0/1 rewards.

Pure Python and numpy. ``get_task("add").sample(n, rng)`` gives training problems,
``.eval_set()`` a disjoint held-out set, and ``.score(problem, completion)`` the reward;
``held_out_reward(job, task, max_tokens)`` a job's greedy reward on that set.
``add``, ``mul`` and ``rev`` have answers of a few tokens; ``sum`` has worked solutions whose
length is heavy-tailed (tens to hundreds of tokens), as reasoning traces are; ``search`` is a
multi-turn agent's task (search a corpus with BM25, then answer; ``Task.respond`` is its environment);
``chat`` is addition in the Tinker cookbook's chat format (``plexrl tinker`` recipes).
"""

from plexrl.tasks._base import EVAL_SIZE, Problem, Task, held_out_reward, is_held_out
from plexrl.tasks.arithmetic import Add, Mul
from plexrl.tasks.chat import ChatAdd
from plexrl.tasks.reasoning import ChainSum
from plexrl.tasks.search import SearchQA
from plexrl.tasks.strings import Reverse

TASKS: dict[str, Task] = {task.name: task for task in (Add(), Mul(), Reverse(), ChainSum(), SearchQA(), ChatAdd())}


def get_task(name: str) -> Task:
    """The task called ``name``; a ``ValueError`` lists the valid names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}") from None


__all__ = [
    "EVAL_SIZE",
    "TASKS",
    "Add",
    "ChainSum",
    "ChatAdd",
    "Mul",
    "Problem",
    "Reverse",
    "SearchQA",
    "Task",
    "get_task",
    "held_out_reward",
    "is_held_out",
]
