"""An OpenAI-API agent learns the search task with GRPO through ``job.openai()``.

    python examples/openai_agent/train.py [--steps 30]              # embedded cluster
    python examples/openai_agent/train.py --coordinator tcp://head:7400

``agent.py`` is the agent: an OpenAI tool-calling loop with no plexrl import. This script serves
the job behind an OpenAI-compatible endpoint, runs the agent against it on the search task's
questions (``plexrl.tasks.search``; the shipped model writes Search-R1's ``<search>`` tags, which
the endpoint's ``tags`` parser turns into tool calls), and trains on the trajectories the
endpoint recorded: token for token what the model was prompted with and sampled, the search
results masked out of the loss, the reward exact match on the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from pathlib import Path

import numpy as np
from openai import AsyncOpenAI

import plexrl
from plexrl.live import LiveView
from plexrl.models import TINY_MODEL
from plexrl.tasks import Problem, get_task
from plexrl.tasks.search import CHAT_TEMPLATE, TURN_END, question, search_text

sys.path.insert(0, str(Path(__file__).parent))
import agent

TASK = get_task("search")


def renderer() -> plexrl.Renderer:
    """The shipped model's tokenizer with the search format as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.chat_template = CHAT_TEMPLATE
    return plexrl.Renderer(tokenizer, turn_end=TURN_END)


async def search(query: str) -> str:
    """The agent's tool: BM25 over the task's corpus."""
    return search_text(query)


async def main(args: argparse.Namespace) -> None:
    cluster = plexrl.connect(args.coordinator) if args.coordinator else plexrl.local(workers=1)
    rng = np.random.default_rng(args.seed)
    spec = {"model": TINY_MODEL, "lora": plexrl.LoRA(rank=args.rank), "optimizer": plexrl.AdamW(lr=args.lr),
            "seed": args.seed}  # fmt: skip
    sessions = itertools.count()
    running = asyncio.Semaphore(args.concurrency)
    async with (
        cluster,
        plexrl.job("openai-agent", **spec) as job,
        job.openai(renderer(), tool_parser="tags") as endpoint,
        AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client,
    ):

        async def episode(problem: Problem, temperature: float) -> tuple[plexrl.Trajectory, float]:
            session = f"e{next(sessions)}"
            async with running:  # as many agents at once as a harness would run
                text = await agent.answer(client, job.name, question(problem), search, temperature=temperature,
                                          extra_headers={"X-Session-Id": session})  # fmt: skip
            (traj,) = endpoint.finish(session)  # the agent never rewrites its history: one trajectory
            return traj, TASK.score(problem, text)

        async def held_out(temperature: float, samples: int) -> float:
            problems = TASK.eval_set()[: args.held_out] * samples
            return float(np.mean([r for _, r in await asyncio.gather(*(episode(p, temperature) for p in problems))]))

        before, greedy_before = await held_out(1.0, 2), await held_out(0.0, 1)
        print(f"held-out exact match before: {before:.3f} (greedy {greedy_before:.3f})", flush=True)
        view = LiveView(["openai-agent"], args.steps, log_every=1)
        for step in range(1, args.steps + 1):
            problems = TASK.sample(args.prompts, rng)
            groups = await asyncio.gather(
                *(asyncio.gather(*(episode(p, 1.0) for _ in range(args.group))) for p in problems)
            )
            trajs = [t for g in groups for t, _ in g]
            rewards = [r for g in groups for _, r in g]
            batch = plexrl.trajectory_batch(trajs, rewards, [i for i, g in enumerate(groups) for _ in g])
            result = await job.optimize(batch, loss="grpo")
            await job.sync_weights()
            view.update("openai-agent", done=step, reward=float(np.mean(rewards)), loss=result.loss)
        after, greedy_after = await held_out(1.0, 2), await held_out(0.0, 1)
    print(f"held-out exact match, T=1 (2 per question): {before:.3f} -> {after:.3f}; greedy: {greedy_before:.3f} -> "
          f"{greedy_after:.3f} ({len(TASK.eval_set()[: args.held_out])} questions, {args.steps} steps of {args.prompts} x "
          f"{args.group} episodes)")  # fmt: skip
    print(f"openai_agent_em_before={before:.3f}")
    print(f"openai_agent_em_after={after:.3f}")
    print(f"openai_agent_em_greedy_before={greedy_before:.3f}")
    print(f"openai_agent_em_greedy_after={greedy_after:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="questions per step")
    parser.add_argument("--group", type=int, default=8, help="episodes per question (a GRPO group)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=64, help="agent episodes running at once")
    parser.add_argument("--held-out", type=int, default=200, help="held-out questions evaluated (of 200)")
    parser.add_argument("--coordinator", default="", help="a shared coordinator's address (default: embedded)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
