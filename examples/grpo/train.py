"""GRPO through plexrl: K jobs, each its own task and LoRA adapter, on one coordinator.

    python examples/grpo/train.py --task add --steps 60            # one job, embedded cluster
    python examples/grpo/train.py --jobs 3 --steps 60              # add, mul and rev at once
    python examples/grpo/train.py --coordinator tcp://head:7400    # a shared cluster

Each job is the textbook loop: sample a group of completions per prompt, score them with the
task's checker, normalise rewards within each group, take a PPO-clip step, publish the new
weights to the sampler. Writes metrics.jsonl, summary.json and reward_curve.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import plexrl
from plexrl.live import LiveView
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.tasks import TASKS, Task, get_task, held_out_reward
from plexrl.text import Renderer

RENDERER = Renderer(CharTokenizer())


async def train(task: Task, seed: int, args: argparse.Namespace, view: LiveView, log: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sampling = plexrl.SamplingParams(n=args.group, max_tokens=args.max_tokens, temperature=1.0)
    lora, adamw = plexrl.LoRA(rank=args.rank), plexrl.AdamW(lr=args.lr)
    async with plexrl.job(task.name, model=args.model, lora=lora, optimizer=adamw, seed=seed) as job:
        initial = await held_out_reward(job, task, args.max_tokens)
        view.update(task.name, held_out=f"{initial:.2f} -> ...")
        for step in range(1, args.steps + 1):
            problems = task.sample(args.prompts, rng)
            prompts = [RENDERER.prompt(p.prompt) for p in problems]
            out = await plexrl.generate(prompts, sampling)
            rewards = [task.score(problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
            result = await plexrl.optimize(plexrl.grpo_batch(prompts, out, rewards), loss="grpo")
            await job.sync_weights()
            view.update(task.name, done=step, reward=float(np.mean(rewards)))
            log(
                job=task.name,
                step=step,
                reward=float(np.mean(rewards)),
                loss=result.loss,
                weight_version=out.weight_version,
                **result.metrics,
            )
        final = await held_out_reward(job, task, args.max_tokens)
        view.update(task.name, held_out=f"{initial:.2f} -> {final:.2f}")
    return {
        "job": task.name,
        "seed": seed,
        "initial": initial,
        "final": final,
        "steps": args.steps,
        "samples": args.steps * args.prompts * args.group,
    }


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    tasks = [get_task(args.task)] if args.jobs == 1 else [TASKS[n] for n in list(TASKS)[: args.jobs]]
    args.out.mkdir(parents=True, exist_ok=True)
    view = LiveView([t.name for t in tasks], args.steps)
    with open(args.out / "metrics.jsonl", "w") as metrics:

        def log(**row: Any) -> None:
            metrics.write(json.dumps({"time": time.time(), **row}) + "\n")

        cluster = plexrl.connect(args.coordinator) if args.coordinator else plexrl.local(workers=args.workers)
        async with cluster as client:
            t0 = time.perf_counter()
            seeds = [
                args.seed + list(TASKS).index(t.name) for t in tasks
            ]  # a job's seed does not depend on its neighbours
            results = await asyncio.gather(*(train(t, s, args, view, log) for t, s in zip(tasks, seeds, strict=True)))
            wall = time.perf_counter() - t0
            status = await client.status()
    busy = sum(w.busy_s for w in status.workers) / (wall * max(1, len(status.workers)))
    summary = {"wall_s": wall, "busy_fraction": busy, "jobs": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{'job':8} {'held-out before':>15} {'held-out after':>14} {'steps':>6} {'samples':>8}")
    for r in results:
        print(f"{r['job']:8} {r['initial']:>15.3f} {r['final']:>14.3f} {r['steps']:>6} {r['samples']:>8}")
    print(f"wall {wall:.0f} s; accelerator busy fraction {busy:.2f} over {len(status.workers)} worker(s)")
    plot(args.out)
    return results


def plot(out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no reward_curve.png (pip install matplotlib)")
        return
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for job in sorted({r["job"] for r in rows}):
        steps = [r["step"] for r in rows if r["job"] == job]
        rewards = np.array([r["reward"] for r in rows if r["job"] == job])
        smooth = np.convolve(rewards, np.ones(5) / 5, mode="valid") if len(rewards) >= 5 else rewards
        ax.plot(steps[len(steps) - len(smooth) :], smooth, label=job)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean sampled reward (5-step average)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=120)
    print(f"wrote {out / 'reward_curve.png'} and {out / 'metrics.jsonl'}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="add", choices=sorted(TASKS), help="the task when --jobs 1")
    p.add_argument("--jobs", type=int, default=1, help=f"concurrent jobs, each its own task (at most {len(TASKS)})")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=TINY_MODEL)
    p.add_argument("--workers", type=int, default=1, help="workers of the embedded cluster")
    p.add_argument(
        "--coordinator",
        default=None,
        help="a shared coordinator's address (default: embedded cluster); your key from $PLEXRL_KEY / $PLEXRL_COORDINATOR_KEY",
    )
    p.add_argument("--out", type=Path, default=Path("runs") / time.strftime("grpo-%Y%m%d-%H%M%S"))
    args = p.parse_args(argv)
    if not 1 <= args.jobs <= len(TASKS):
        p.error(f"--jobs must be between 1 and {len(TASKS)}")
    return args


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parse()))
