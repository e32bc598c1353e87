"""Two RL jobs share one embedded plexrl cluster, each with its own LoRA adapter and reward.

    python examples/two_jobs.py [--steps 15] [--workers 1]

Each job is an ordinary GRPO loop: sample a group per prompt, score, normalise within groups,
optimize, publish the new weights to the sampler. plexrl interleaves the two jobs' calls on the
shared worker. The model is the project's tiny random decoder; the rewards are toy ones
(job "sevens" likes the token 7, job "small" likes token ids below 16).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import plexrl
from plexrl.models import write_random_model

PROMPTS = [[1, 3, 4], [1, 5, 9, 12], [1, 8], [1, 6, 6, 6]]
SAMPLING = plexrl.SamplingParams(n=8, max_tokens=8, temperature=1.0)


def sevens(tokens: np.ndarray) -> float:
    return float(np.mean(tokens == 7))


def small(tokens: np.ndarray) -> float:
    return float(np.mean(tokens < 16))


async def train(
    name: str, reward: Callable[[np.ndarray], float], model: Path, steps: int, seed: int
) -> dict[str, float]:
    async with plexrl.job(
        name, model=model, lora=plexrl.LoRA(rank=8), optimizer=plexrl.AdamW(lr=2e-2), seed=seed
    ) as job:
        curve = []
        for step in range(steps):
            out = await plexrl.generate(PROMPTS, SAMPLING)
            rewards = [reward(s.tokens) for s in out.samples]
            result = await plexrl.optimize(plexrl.grpo_batch(PROMPTS, out, rewards), loss="grpo")
            await job.sync_weights()
            curve.append(float(np.mean(rewards)))
            print(
                f"[{name:6}] step {step + 1:2}/{steps}  reward {curve[-1]:.3f}  loss {result.loss:+.4f}  weights v{out.weight_version + 1}",
                flush=True,
            )
        return {"first": curve[0], "last": float(np.mean(curve[-3:])), "samples": steps * len(PROMPTS) * SAMPLING.n}


async def main(steps: int, workers: int) -> None:
    model = write_random_model(Path(tempfile.mkdtemp(prefix="plexrl-")) / "tiny", seed=0)
    print(f"starting an embedded cluster with {workers} worker(s)...", flush=True)
    async with plexrl.local(workers=workers) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            train("sevens", sevens, model, steps, seed=1), train("small", small, model, steps, seed=2)
        )
        wall = time.perf_counter() - t0
        status = await client.status()
    busy = sum(w.busy_s for w in status.workers) / (wall * len(status.workers))
    print(f"\n{'job':8} {'reward first':>12} {'reward last 3':>13} {'steps':>6} {'samples':>8}")
    for name, r in zip(["sevens", "small"], results, strict=True):
        print(f"{name:8} {r['first']:>12.3f} {r['last']:>13.3f} {steps:>6} {int(r['samples']):>8}")
    print(f"wall {wall:.1f} s; worker busy fraction {busy:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.workers))
