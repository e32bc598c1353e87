"""Agent episodes (``plexrl.rollout.play``) through real processes, on the shipped model (it knows
the search format): turns and the tool's observations alternate token-exactly, per-turn seeds make
an episode reproducible whatever else runs, and a single-turn task is one turn."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import completion, play, turn_params
from plexrl.tasks import Problem, get_task
from plexrl.text import Renderer

TOK = Renderer(CharTokenizer())


@pytest.mark.asyncio
async def test_an_episode_alternates_turns_and_tool_observations() -> None:
    task = get_task("search")
    problems = task.eval_set()[:4]
    seen: list[tuple[str, str]] = []

    async def tool(problem: Problem, response: str) -> str | None:
        seen.append((problem.prompt, response))
        await asyncio.sleep(0)  # a tool is awaited: other episodes run meanwhile
        return task.respond(problem, response)

    async with plexrl.local(workers=1), plexrl.job("agent", model=TINY_MODEL) as job:
        greedy = turn_params(task, TOK, temperature=0.0)
        trajs = await asyncio.gather(*(play(job, task, p, greedy, TOK, tool=tool) for p in problems))
    searched = [t for t in trajs if len(t.turns) > 1]
    assert searched, "the shipped model searches before it answers"
    for problem, traj in zip(problems, trajs, strict=True):
        assert traj.stop_reason in ("answered", "max_turns", "max_tokens")
        for i, turn in enumerate(traj.turns[:-1]):
            # what followed each turn is exactly the tokenized result of the search it wrote
            response = TOK.text(np.concatenate([np.concatenate([t.tokens, t.observation]) for t in traj.turns[:i]]
                                                 + [turn.tokens]))  # fmt: skip
            expected = task.respond(problem, response)
            assert expected is not None and turn.observation.tolist() == TOK.observation(expected)
            assert TOK.text(turn.tokens).endswith(task.turn_end or "?")  # each turn ends at the marker (a stop string)
        assert completion(traj, TOK).startswith(TOK.text(traj.turns[0].tokens))
    assert len(seen) == sum(len(t.turns) for t in trajs)  # the tool answered every turn


@pytest.mark.asyncio
async def test_seeded_episodes_are_reproducible_and_a_single_turn_task_is_one_turn() -> None:
    search, chain = get_task("search"), get_task("sum")
    problem = search.eval_set()[0]
    params = turn_params(search, TOK)  # temperature 1
    async with plexrl.local(workers=1), plexrl.job("seeded", model=TINY_MODEL) as job:
        first = await play(job, search, problem, params, TOK, seed=7)
        # the same seed while other episodes run at once: the same tokens, turn by turn
        again, *_ = await asyncio.gather(
            play(job, search, problem, params, TOK, seed=7),
            *(play(job, search, p, params, TOK, seed=11) for p in search.eval_set()[1:4]),
        )
        single = await play(job, chain, chain.eval_set()[0], turn_params(chain, TOK), TOK, seed=3)
    assert [t.tokens.tolist() for t in first.turns] == [t.tokens.tolist() for t in again.turns]
    assert len(single.turns) == 1 and single.stop_reason == "done"
    assert completion(single, TOK) == TOK.text(single.turns[0].tokens)  # nothing observed after it
