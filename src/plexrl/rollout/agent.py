"""One agent episode of a task: the model's turns and the environment's answers, token-exact.

    renderer = Renderer(tokenizer)  # CharTokenizer(), or a transformers tokenizer (its chat template)
    traj = await play(job, get_task("search"), problem, turn_params(task, renderer), renderer)
    reward = task.score(problem, completion(traj, renderer))

A multi-turn task (``task.turn_end``, ``task.respond``) alternates turns and observations until
the environment has nothing more to say (it answered) or a budget ends it; a single-turn task
is one turn. ``tool`` replaces the environment call, e.g. to put a hosted tool's latency in
front of it: while it waits, the job holds no accelerator.

Through a chat template (``renderer.chat``) the problem is the user's message, a turn ends at the
template's end-of-turn token instead of the task's ``turn_end``, and an observation is a ``tool``
message (a turn cut short by its token budget ends the episode: "truncated"); without one, turns
end at ``turn_end`` (a stop string) and observations are plain text.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from plexrl.client.trajectory import Trajectory
from plexrl.tasks import Problem, Task
from plexrl.text import Renderer
from plexrl.types import SamplingParams

if TYPE_CHECKING:
    from plexrl.client.job import Job

Tool = Callable[[Problem, str], Awaitable[str | None]]  # (problem, response so far) -> observation


def turn_params(task: Task, renderer: Renderer, *, temperature: float = 1.0) -> SamplingParams:
    """One turn's sampling: up to the task's turn budget, ending at EOS or an end-of-turn token, or
    (plain text) at the task's turn marker."""
    stop = (task.turn_end,) if task.turn_end and not renderer.chat else ()
    return renderer.turn(max_tokens=task.max_turn_tokens or task.max_tokens, temperature=temperature, stop=stop)


def completion(traj: Trajectory, renderer: Renderer) -> str:
    """Everything after the prompt, observations included, as text without special tokens (what
    ``task.score`` reads)."""
    return renderer.text(traj.tokens[len(traj.prompt) :])


async def play(
    job: Job,
    task: Task,
    problem: Problem,
    params: SamplingParams,
    renderer: Renderer,
    *,
    tool: Tool | None = None,
    seed: int | None = None,
) -> Trajectory:
    """One trajectory of ``task`` on ``problem``. ``seed``: turn ``i`` samples with ``seed + i``
    (reproducible whatever order the job's calls reach the sampler in); None: the job's own."""
    prompt = renderer.prompt(problem.prompt)
    traj = job.trajectory(prompt, max_turns=task.max_turns, max_tokens=len(prompt) + task.max_tokens)
    while True:
        this_turn = params if seed is None else msgspec.structs.replace(params, seed=seed + len(traj.turns))
        turn = await traj.generate(this_turn)
        if turn is None:
            break
        if renderer.chat and turn.finish_reason != "stop":  # no end-of-turn: a tool turn cannot follow it
            traj.stop("truncated")
            break
        start = time.monotonic()
        response = completion(traj, renderer)
        observation = await tool(problem, response) if tool is not None else task.respond(problem, response)
        if observation is None:  # it answered, or wrote no tool call: the episode is over
            traj.stop("answered" if task.turn_end else "done")
            break
        traj.observe(renderer.observation(observation), ok=task.observation_ok(observation),
                     latency_s=time.monotonic() - start)  # fmt: skip
    return traj
