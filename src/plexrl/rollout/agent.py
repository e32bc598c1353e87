"""One agent episode of a task: the model's turns and the environment's answers, token-exact.

    traj = await play(job, get_task("search"), problem, params, tokenizer)
    reward = task.score(problem, completion(traj, tokenizer))

A multi-turn task (``task.turn_end``, ``task.respond``) alternates turns and observations until
the environment has nothing more to say (it answered) or a budget ends it; a single-turn task
is one turn. ``tool`` replaces the environment call, e.g. to put a hosted tool's latency in
front of it: while it waits, the job holds no accelerator.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from plexrl.client.trajectory import Trajectory
from plexrl.models.tokenizer import CharTokenizer
from plexrl.tasks import Problem, Task
from plexrl.types import SamplingParams

if TYPE_CHECKING:
    from plexrl.client.job import Job

Tool = Callable[[Problem, str], Awaitable[str | None]]  # (problem, response so far) -> observation


def turn_params(task: Task, tokenizer: CharTokenizer, *, temperature: float = 1.0) -> SamplingParams:
    """One turn's sampling: up to the task's turn budget, ending at its turn marker."""
    stop = tuple(tokenizer.encode(task.turn_end, bos=False)) if task.turn_end else ()
    return SamplingParams(max_tokens=task.max_turn_tokens or task.max_tokens, temperature=temperature,
                          stop_token_ids=stop)  # fmt: skip


def completion(traj: Trajectory, tokenizer: CharTokenizer) -> str:
    """Everything after the prompt, observations included, as text (what ``task.score`` reads)."""
    return tokenizer.decode(traj.tokens[len(traj.prompt) :])


async def play(
    job: Job,
    task: Task,
    problem: Problem,
    params: SamplingParams,
    tokenizer: CharTokenizer,
    *,
    tool: Tool | None = None,
    seed: int | None = None,
) -> Trajectory:
    """One trajectory of ``task`` on ``problem``. ``seed``: turn ``i`` samples with ``seed + i``
    (reproducible whatever order the job's calls reach the sampler in); None: the job's own."""
    prompt = tokenizer.encode(problem.prompt)
    traj = job.trajectory(prompt, max_turns=task.max_turns, max_tokens=len(prompt) + task.max_tokens)
    while True:
        this_turn = params if seed is None else msgspec.structs.replace(params, seed=seed + len(traj.turns))
        if await traj.generate(this_turn) is None:
            break
        start = time.monotonic()
        response = completion(traj, tokenizer)
        observation = await tool(problem, response) if tool is not None else task.respond(problem, response)
        if observation is None:  # it answered, or wrote no tool call: the episode is over
            traj.stop("answered" if task.turn_end else "done")
            break
        traj.observe(tokenizer.encode(observation, bos=False), ok=task.observation_ok(observation),
                     latency_s=time.monotonic() - start)  # fmt: skip
    return traj
