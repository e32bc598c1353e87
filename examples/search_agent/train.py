"""A search agent learns multi-hop question answering with GRPO through plexrl (Search-R1's format).

    python examples/search_agent/train.py [--steps 30]              # embedded cluster
    python examples/search_agent/train.py --coordinator tcp://head:7400

Each question is about made-up people, cities and lands (``plexrl.tasks.search``), so the model
must search: it writes ``<search>name</search>``, the tool runs BM25 over the shipped corpus and
the result comes back as ``<information>...</information>`` tokens, until the model writes
``<answer>...</answer>``. Every trajectory's turns are token-exact (``job.trajectory``); the
information tokens are masked out of the loss; the reward is exact match on the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import time

import numpy as np

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.tasks import Problem, get_task

TASK, TOK = get_task("search"), CharTokenizer()
NEWLINE = TOK.encode("\n", bos=False)[0]  # ends a turn: the tool answers it


async def run_agent(job: plexrl.Job, problem: Problem, params: plexrl.SamplingParams) -> plexrl.Trajectory:
    """One trajectory: turns until an answer, a non-search turn or a budget ends it."""
    prompt = TOK.encode(problem.prompt)
    traj = job.trajectory(prompt, max_turns=TASK.max_turns, max_tokens=len(prompt) + TASK.max_tokens)
    while await traj.generate(params) is not None:
        start = time.monotonic()
        observation = TASK.respond(problem, response(traj))  # the tool: BM25 over the corpus
        if observation is None:  # it answered (or wrote no search)
            traj.stop("answered")
            break
        traj.observe(TOK.encode(observation, bos=False), ok="no results" not in observation,
                     latency_s=time.monotonic() - start)  # fmt: skip
    return traj


def response(traj: plexrl.Trajectory) -> str:
    return TOK.decode(traj.tokens[len(traj.prompt) :])


async def held_out(job: plexrl.Job, samples: int = 4) -> tuple[float, float, list[plexrl.Trajectory]]:
    """Exact match on the held-out questions (people never trained on): of the policy's own
    trajectories (temperature 1, ``samples`` per question), and of greedy ones."""
    problems = TASK.eval_set()
    turn = TASK.max_turn_tokens or 64
    sampled_params = plexrl.SamplingParams(max_tokens=turn, temperature=1.0, stop_token_ids=(NEWLINE,))
    greedy_params = plexrl.SamplingParams(max_tokens=turn, temperature=0.0, stop_token_ids=(NEWLINE,))
    repeated = problems * samples
    sampled, greedy = await asyncio.gather(
        asyncio.gather(*(run_agent(job, p, sampled_params) for p in repeated)),
        asyncio.gather(*(run_agent(job, p, greedy_params) for p in problems)),
    )
    em = [TASK.score(p, response(t)) for p, t in zip(repeated, sampled, strict=True)]
    em_greedy = [TASK.score(p, response(t)) for p, t in zip(problems, greedy, strict=True)]
    return float(np.mean(em)), float(np.mean(em_greedy)), list(sampled)


async def main(args: argparse.Namespace) -> None:
    cluster = plexrl.connect(args.coordinator) if args.coordinator else plexrl.local(workers=1)
    rng = np.random.default_rng(args.seed)
    params = plexrl.SamplingParams(max_tokens=TASK.max_turn_tokens or 64, temperature=1.0, stop_token_ids=(NEWLINE,))
    lora, adamw = plexrl.LoRA(rank=args.rank), plexrl.AdamW(lr=args.lr)
    async with cluster, plexrl.job("search-agent", model=TINY_MODEL, lora=lora, optimizer=adamw) as job:
        before, greedy_before, _ = await held_out(job)
        print(f"held-out exact match before: {before:.3f} (greedy {greedy_before:.3f})", flush=True)
        for step in range(1, args.steps + 1):
            problems = TASK.sample(args.prompts, rng)
            trajs = await asyncio.gather(*(run_agent(job, p, params) for p in problems for _ in range(args.group)))
            rewards = [TASK.score(problems[i // args.group], response(t)) for i, t in enumerate(trajs)]
            group = np.repeat(np.arange(args.prompts), args.group)
            result = await plexrl.optimize(plexrl.trajectory_batch(trajs, rewards, group), loss="grpo")
            await job.sync_weights()
            turns = np.mean([len(t.turns) for t in trajs])
            print(
                f"step {step:3d}  reward {np.mean(rewards):.3f}  turns {turns:.2f}  loss {result.loss:+.4f}", flush=True
            )
        after, greedy_after, final = await held_out(job)
    counts = collections.Counter(len(t.turns) for t in final)
    hit = plexrl.prefix_cache_hit_rate(final)
    print(f"held-out exact match, T=1 samples (4 per question): {before:.3f} -> {after:.3f}; greedy: "
          f"{greedy_before:.3f} -> {greedy_after:.3f} ({len(TASK.eval_set())} questions, {args.steps} steps of "
          f"{args.prompts} x {args.group} trajectories)")  # fmt: skip
    print("turns per held-out trajectory: " + ", ".join(f"{k}: {counts[k]}" for k in sorted(counts)))
    print("prefix-cache hit rate of later turns: " + ("n/a (no prefix cache)" if hit is None else f"{hit:.2f}"))
    print(f"search_agent_em_greedy_before={greedy_before:.3f}")
    print(f"search_agent_em_greedy_after={greedy_after:.3f}")
    print(f"search_agent_em_before={before:.3f}")
    print(f"search_agent_em_after={after:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="questions per step")
    parser.add_argument("--group", type=int, default=8, help="trajectories per question (a GRPO group)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coordinator", default="", help="a shared coordinator's address (default: embedded)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
