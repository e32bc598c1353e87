"""A search agent learns multi-hop question answering with GRPO through plexrl (Search-R1's format).

    python examples/search_agent/train.py [--steps 30]              # embedded cluster
    python examples/search_agent/train.py --max-staleness 1         # asynchronous: sample while training
    python examples/search_agent/train.py --coordinator tcp://head:7400

Each question is about made-up people, cities and lands (``plexrl.tasks.search``), so the model
must search: it writes ``<search>name</search>``, the tool runs BM25 over the shipped corpus and
the result comes back as ``<information>...</information>`` tokens, until the model writes
``<answer>...</answer>``. Every trajectory's turns are token-exact (``job.trajectory``); the
information tokens are masked out of the loss; the reward is exact match on the answer.
``train_async`` runs the loop: with ``--max-staleness 0`` (default) it is synchronous GRPO; with
k > 0 new groups start while the trainer trains, on weights at most k versions old.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib

import numpy as np

import plexrl
from plexrl.live import LiveView
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import completion, play, train_async, turn_params
from plexrl.tasks import get_task
from plexrl.text import Renderer

TASK, RENDERER = get_task("search"), Renderer(CharTokenizer())


def response(traj: plexrl.Trajectory) -> str:
    return completion(traj, RENDERER)


async def held_out(job: plexrl.Job, samples: int = 4) -> tuple[float, float, list[plexrl.Trajectory]]:
    """Exact match on the held-out questions (people never trained on): of the policy's own
    trajectories (temperature 1, ``samples`` per question), and of greedy ones."""
    problems = TASK.eval_set()
    sampled_params, greedy_params = turn_params(TASK, RENDERER), turn_params(TASK, RENDERER, temperature=0.0)
    repeated = problems * samples
    sampled, greedy = await asyncio.gather(
        asyncio.gather(*(play(job, TASK, p, sampled_params, RENDERER) for p in repeated)),
        asyncio.gather(*(play(job, TASK, p, greedy_params, RENDERER) for p in problems)),
    )
    em = [TASK.score(p, response(t)) for p, t in zip(repeated, sampled, strict=True)]
    em_greedy = [TASK.score(p, response(t)) for p, t in zip(problems, greedy, strict=True)]
    return float(np.mean(em)), float(np.mean(em_greedy)), list(sampled)


async def main(args: argparse.Namespace) -> None:
    cluster = plexrl.connect(args.coordinator) if args.coordinator else plexrl.local(workers=1)
    rng = np.random.default_rng(args.seed)
    params = turn_params(TASK, RENDERER)
    lora, adamw = plexrl.LoRA(rank=args.rank), plexrl.AdamW(lr=args.lr)
    spec = {"model": TINY_MODEL, "lora": lora, "optimizer": adamw, "max_staleness": args.max_staleness}
    async with cluster, plexrl.job("search-agent", **spec) as job:
        before, greedy_before, _ = await held_out(job)
        print(f"held-out exact match before: {before:.3f} (greedy {greedy_before:.3f})", flush=True)

        async def group(index: int) -> tuple[list[plexrl.Trajectory], list[float]]:
            problem = TASK.sample(1, rng)[0]  # drawn in index order: before the first await
            trajs = await asyncio.gather(*(play(job, TASK, problem, params, RENDERER) for _ in range(args.group)))
            return list(trajs), [TASK.score(problem, response(t)) for t in trajs]

        loss = "decoupled_ppo" if args.max_staleness else "grpo"  # k = 0: synchronous, on-policy
        view = LiveView(["search-agent"], args.steps, log_every=1)
        async for step in train_async(job, group, groups_per_step=args.prompts, steps=args.steps, loss=loss):
            m = step.result.metrics
            view.update("search-agent", done=step.step, reward=float(np.mean(step.rewards)), loss=step.result.loss,
                        staleness=f"{m.get('staleness_mean', 0):.2f} (max {m.get('staleness_max', 0):.0f})",
                        dropped=step.dropped)  # fmt: skip
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
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="k > 0: sample while training, on weights up to k versions old (decoupled PPO)")  # fmt: skip
    parser.add_argument(
        "--coordinator",
        default="",
        help="a shared coordinator's address (default: embedded); your key from $PLEXRL_KEY / $PLEXRL_COORDINATOR_KEY",
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
