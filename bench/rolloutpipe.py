"""RolloutPipe against the synchronous baseline, on two workers (trainer and sampler apart).

    python bench/rolloutpipe.py [--prompts 16] [--steps 3] [--out bench-out/rolloutpipe]

One disaggregated LoRA GRPO job (KL to the base, beta 0.04) on the shipped tiny model (task
``add``): its generates run on
one worker, its training on the other, new weights pushed on every ``sync_weights``. Each
rollout samples ``--prompts`` groups of G completions; the same prompts and seeds go to three
modes, in turn, for ``--steps`` GRPO steps each, over four settings (G x max tokens):

- (a) sync: the whole rollout, then train (forward_backward per group, one optim_step);
- (b) complete-group pipelining (CGP): each group is trained on as soon as it is complete,
  with the engine's default admission (every sample its own request, groups interleaved);
- (c) CGP + frontier-group dispatch (FGD): the requests of the groups the trainer needs next
  are admitted first (group by group, by priority), the rest backfill.

The three do the same generation work (generate calls of G sequences). (a) admits group by group
as (c) does (for a synchronous rollout the order does not matter), so (a) and (c) sample exactly
the same groups and train on them in the same order: their learning curves must agree (the
table's rewards per step). Metrics per
rollout (client clock): rollout-to-train-end (first admission to the optimizer step's end) and
the trainer waiting ratio (time the trainer had nothing to train, over that window); the table
shows each mode's mean over its steps. Ends with the worst setting's reductions of (c) vs (a):
``rollout_to_train_end_reduction_min=`` and ``trainer_waiting_ratio_reduction_min=``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import statistics
from pathlib import Path

import numpy as np

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import RolloutMetrics, train
from plexrl.tasks import get_task

TOKENIZER = CharTokenizer()
LOSS = plexrl.LossConfig(kl_coef=0.04)  # GRPO with its usual KL to the base model (DeepSeekMath's beta)
MODES = {"a": ("sync", "frontier", False), "b": ("CGP", "arrival", True), "c": ("CGP+FGD", "frontier", True)}


async def run_mode(
    mode: str, group: int, max_tokens: int, args: argparse.Namespace
) -> tuple[list[RolloutMetrics], list[float]]:
    """``args.steps`` GRPO steps of one fresh job in ``mode``; its metrics and mean rewards per step."""
    _, admission, pipelined = MODES[mode]
    task = get_task("add")
    rng = np.random.default_rng(7)  # the same prompts in every mode
    params = plexrl.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    metrics: list[RolloutMetrics] = []
    rewards: list[float] = []
    lora, adamw = plexrl.LoRA(rank=8), plexrl.AdamW(lr=3e-2)
    async with plexrl.job(f"pipe-{mode}", model=TINY_MODEL, lora=lora, optimizer=adamw, seed=1,
                          placement="disaggregated") as job:  # fmt: skip
        for _ in range(args.steps):
            problems = task.sample(args.prompts, rng)
            prompts = [TOKENIZER.encode(p.prompt) for p in problems]

            def score(i: int, sample: plexrl.Sample, problems: list = problems) -> float:  # type: ignore[type-arg]
                return task.score(problems[i], TOKENIZER.decode(sample.tokens))

            rollout = job.rollout(prompts, n=group, reward=score, params=params, chunk=group, admission=admission)
            # Pipelined: train on each group as it arrives; sync: on all of them once all are in.
            groups = rollout if pipelined else [g async for g in rollout]
            await train(job, groups, per_call=1, loss_config=LOSS, metrics=rollout.metrics)
            await job.sync_weights()
            metrics.append(rollout.metrics)
            rewards.append(float(np.mean([r for g in rollout.groups for r in g.rewards])))
    return metrics, rewards


async def main(args: argparse.Namespace) -> None:
    settings = [(g, t) for g in args.groups for t in args.max_tokens]
    rows = []
    async with plexrl.local(workers=2):
        await run_mode("c", 4, 4, argparse.Namespace(**{**vars(args), "steps": 1}))  # warm both workers
        for group, max_tokens in settings:
            per_mode = {}
            for mode in MODES:
                per_mode[mode] = await run_mode(mode, group, max_tokens, args)
                m, _ = per_mode[mode]
                print(f"  G={group} max_tokens={max_tokens} ({MODES[mode][0]}): rollout-to-train-end "
                      f"{statistics.mean(x.rollout_to_train_end_s for x in m):.3f} s", flush=True)  # fmt: skip
            rows.append((group, max_tokens, per_mode))

    print(f"\n{args.prompts} groups per rollout, {args.steps} steps per mode; means over steps")
    print(f"{'G':>3} {'max_tok':>7} | {'rollout-to-train-end s (a / b / c)':>36} | {'trainer waiting (a / b / c)':>27} | "
          f"{'R2TE red.':>9} {'wait red.':>9} | {'mean reward a / c':>17}")  # fmt: skip
    worst_r2te, worst_wait, same = 1.0, 1.0, True
    for group, max_tokens, per_mode in rows:
        r2te = {k: statistics.mean(x.rollout_to_train_end_s for x in v[0]) for k, v in per_mode.items()}
        wait = {k: statistics.mean(x.trainer_waiting_ratio for x in v[0]) for k, v in per_mode.items()}
        red_r2te = 1 - r2te["c"] / r2te["a"]
        red_wait = 1 - wait["c"] / wait["a"]
        worst_r2te, worst_wait = min(worst_r2te, red_r2te), min(worst_wait, red_wait)
        ra, rc = per_mode["a"][1], per_mode["c"][1]
        same &= ra == rc
        print(f"{group:>3} {max_tokens:>7} | {r2te['a']:>10.3f} / {r2te['b']:>10.3f} / {r2te['c']:>10.3f} | "
              f"{wait['a']:>7.3f} / {wait['b']:>7.3f} / {wait['c']:>7.3f} | {red_r2te:>9.3f} {red_wait:>9.3f} | "
              f"{np.mean(ra):>7.4f} / {np.mean(rc):>7.4f}")  # fmt: skip
    print(f"(a) and (c): the same reward at every step in every setting (the same on-policy run): {same}")
    _plot(rows, Path(args.out))
    print(f"rollout_to_train_end_reduction_min={worst_r2te:.3f}")
    print(f"trainer_waiting_ratio_reduction_min={worst_wait:.3f}")


def _plot(rows: list, out: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(rows))
    for k, mode in enumerate(MODES):
        means = [statistics.mean(m.rollout_to_train_end_s for m in per_mode[mode][0]) for *_, per_mode in rows]
        ax.bar(x + (k - 1) * 0.27, means, 0.27, label=f"({mode}) {MODES[mode][0]}")
    ax.set_xticks(x, [f"G={g}, {t} tok" for g, t, _ in rows])
    ax.set_ylabel("rollout-to-train-end (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rolloutpipe.png", dpi=110)
    print(f"plot: {out / 'rolloutpipe.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="groups per rollout")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per mode and setting")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8], help="group sizes G")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--out", default="bench-out/rolloutpipe")
    asyncio.run(main(parser.parse_args()))
