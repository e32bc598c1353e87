"""Jobs on a gang of workers (``plexrl.job(..., devices=2)``) on CPU: real processes, two workers
pinned to one core each (``plexrl.local(workers=2, cpus_per_worker=1)``; the coordinator and
this script run beside them, unpinned).

    python bench/gang.py [--part fits|dp|libra|all] [--repeats 3] [--steps 40]

- ``fits``: a full fine-tune of the shipped model (``plexrl.models.TINY_MODEL``) whose state
  does not fit one worker's ``--memory-budget`` (float32 masters, gradients and two AdamW
  moments: 16 bytes a parameter; the budget is 12) is refused with ``devices=1`` and trains with
  ``devices=2`` (FSDP2: each member holds half), on the demo's task ``rev`` with the demo's GRPO
  loop: the held-out reward (greedy answers on the task's held-out set) before and after.
  ``gang_full_ft_fits=1`` only if it was refused on one worker and its held-out reward rose.
- ``dp``: a training-bound LoRA job (``--rows`` rows of ``--length`` tokens a step, the
  ``grpo`` loss): the seconds of ``forward_backward`` + ``optim_step`` with 1 and with 2
  data-parallel members, the two alternating within each repetition (fresh jobs each time, the
  first step of each excluded as warm-up). ``dp2_step_speedup`` is the median over repetitions
  of one member's time over two's; its limit is 2 (two cores, nothing else on them).

- ``libra``: the real part of ``bench/libra.py`` (its defaults, ``--repeats``), whose libra mode
  now moves workers both ways: the home lent to rollout while its jobs roll out, the rollout
  worker joining a job's training (data parallel, ``scheduler/elastic.py``) while no turn waits.
  ``throughput_gain_real`` is its trained samples per second over the stronger of its static and
  colocated baselines, repetition by repetition (mean, worst beside it; its limits are printed
  above it).

The last lines are ``gang_full_ft_fits=``, ``dp2_step_speedup=``, ``throughput_gain_real=``. The
workers sample with the default sampler (vLLM where installed; the libra part always uses vLLM).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `plexrl worker` does, before torch loads

import argparse
import asyncio
import statistics
import time

import numpy as np

import plexrl
from plexrl.errors import JobTooLargeError
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.plan import ModelShape
from plexrl.tasks import get_task, held_out_reward
from plexrl.text import Renderer

RENDERER = Renderer(CharTokenizer())


async def fits(args: argparse.Namespace) -> bool:
    """A full fine-tune too large for one worker: refused on one, trained on a gang of two."""
    params = ModelShape.read(TINY_MODEL).params  # type: ignore[union-attr]  # the shipped model has a config
    budget = 12 * params
    task, rng = get_task("rev"), np.random.default_rng(args.seed)
    adamw = plexrl.AdamW(lr=args.full_lr)
    print(f"fits: full fine-tune of {params:,} parameters (state {16 * params / 2**20:.1f} MiB alone, "
          f"{8 * params / 2**20:.1f} MiB a member of two), budget {budget / 2**20:.1f} MiB a worker")  # fmt: skip
    async with plexrl.local(workers=2, cpus_per_worker=1, memory_budget_bytes=budget, sampler=args.sampler) as client:
        try:
            async with plexrl.job("alone", model=TINY_MODEL, lora=None, optimizer=adamw, seed=args.seed):
                refused = False
        except JobTooLargeError as e:
            refused = True
            print(f"  devices=1: refused ({e.message[:160]}...)")
        sampling = plexrl.SamplingParams(n=args.group, max_tokens=args.max_tokens, temperature=1.0)
        async with plexrl.job("gang", model=TINY_MODEL, lora=None, optimizer=adamw, seed=args.seed, devices=2) as job:
            members = next(j.members for j in (await client.status()).jobs if j.job_id == job.job_id)
            before = await held_out_reward(job, task, args.max_tokens)
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                problems = task.sample(args.prompts, rng)
                prompts = [RENDERER.prompt(p.prompt) for p in problems]
                out = await job.generate(prompts, sampling)
                rewards = [task.score(problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
                await job.optimize(plexrl.grpo_batch(prompts, out, rewards), loss="grpo")
                await job.sync_weights()
                if step % 10 == 0:
                    print(f"  step {step}: train reward {np.mean(rewards):.3f}", flush=True)
            seconds = time.perf_counter() - start
            after = await held_out_reward(job, task, args.max_tokens)
    print(f"  devices=2 on {', '.join(members)}: held-out reward {before:.3f} -> {after:.3f} in {args.steps} steps "
          f"({seconds:.0f} s)")  # fmt: skip
    return refused and after > before


def training_batch(rows: int, length: int, seed: int) -> plexrl.Batch:
    """``rows`` GRPO rows of ``length`` tokens (a quarter prompt), random advantages."""
    rng = np.random.default_rng(seed)
    prompt = length // 4
    return plexrl.Batch(
        tokens=plexrl.Ragged.from_rows([rng.integers(3, 40, size=length).tolist() for _ in range(rows)], "int32"),
        prompt_lens_B=np.full(rows, prompt, np.int32),
        sampler_logprobs=plexrl.Ragged.from_rows([[-1.0] * (length - prompt)] * rows, "float32"),
        advantages_B=rng.normal(size=rows).astype(np.float32),
    )


async def step_seconds(devices: int, args: argparse.Namespace, repeat: int) -> float:
    """Mean seconds of forward_backward + optim_step over ``--dp-steps`` steps (after one warm-up)."""
    lora = plexrl.LoRA(rank=8)
    async with plexrl.job(f"dp{devices}-{repeat}", TINY_MODEL, lora=lora, seed=args.seed, devices=devices) as job:
        await job.optimize(training_batch(args.rows, args.length, 0))
        start = time.perf_counter()
        for i in range(args.dp_steps):
            await job.optimize(training_batch(args.rows, args.length, i + 1))
        return (time.perf_counter() - start) / args.dp_steps


async def dp(args: argparse.Namespace) -> float:
    """One LoRA job's training step with one and with two data-parallel members."""
    print(f"dp: LoRA rank 8, {args.rows} rows x {args.length} tokens a step, {args.dp_steps} steps a run")
    ratios, times = [], {1: [], 2: []}
    async with plexrl.local(workers=2, cpus_per_worker=1, sampler=args.sampler):
        for r in range(args.repeats):
            one, two = await step_seconds(1, args, r), await step_seconds(2, args, r)
            times[1].append(one)
            times[2].append(two)
            ratios.append(one / two)
            print(f"  repetition {r + 1}: 1 member {one:.3f} s/step, 2 members {two:.3f} s/step: {one / two:.2f}x",
                  flush=True)  # fmt: skip
    for k, ts in times.items():
        print(f"  {k} member(s): {statistics.mean(ts):.3f} s/step [{min(ts):.3f}-{max(ts):.3f}]")
    speedup = statistics.median(ratios)
    print(f"  speedup {speedup:.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] (limit 2.00: two cores)")
    return speedup


def libra_real(args: argparse.Namespace) -> list[float]:
    """bench/libra.py's real part: libra's throughput gain over the stronger baseline, per repetition."""
    import libra  # bench/, beside this script

    print("libra: bench/libra.py's real part (static, libra with roles moving both ways, colocated)", flush=True)
    gain, _ = libra.real_part(libra.parse(["--part", "real", "--repeats", str(args.repeats)]))
    return gain


def main(args: argparse.Namespace) -> None:
    fit = asyncio.run(fits(args)) if args.part in ("fits", "all") else None
    speedup = asyncio.run(dp(args)) if args.part in ("dp", "all") else None
    gain = libra_real(args) if args.part in ("libra", "all") else None
    if fit is not None:
        print(f"gang_full_ft_fits={int(fit)}")
    if speedup is not None:
        print(f"dp2_step_speedup={speedup:.2f}")
    if gain is not None:
        print(f"throughput_gain_real={statistics.mean(gain):.2f} (worst {min(gain):.2f}; over the stronger of static "
              "and colocated)")  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["fits", "dp", "libra", "all"], default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=40, help="fits: GRPO steps of the full fine-tune")
    p.add_argument("--prompts", type=int, default=16, help="fits: prompts a step")
    p.add_argument("--group", type=int, default=8, help="fits: completions a prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="fits: tokens a completion")
    p.add_argument("--full-lr", type=float, default=1e-4, help="fits: the full fine-tune's AdamW learning rate")
    p.add_argument("--rows", type=int, default=64, help="dp: rows a step")
    p.add_argument("--length", type=int, default=256, help="dp: tokens a row")
    p.add_argument("--dp-steps", type=int, default=3, help="dp: timed steps a run")
    p.add_argument(
        "--sampler", choices=["vllm", "hf"], default=None, help="the workers' sampler (default: vllm where installed)"
    )
    return p.parse_args()


if __name__ == "__main__":
    main(parse())
