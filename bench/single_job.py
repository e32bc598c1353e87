"""One GRPO job, plexrl against TRL: what a user with a single job would pick instead of plexrl.

    python bench/single_job.py [--steps 4] [--prompts 8] [--group 8] [--max-tokens 48] [--repeats 3]

The same LoRA GRPO job runs three ways on the shipped tiny model (``plexrl.models.TINY_MODEL``)
and task ``sum``:

- ``plexrl-vllm`` / ``plexrl-hf``: through plexrl, an embedded cluster
  ``plexrl.local(workers=1, cpus_per_worker=1, sampler=...)`` with the vLLM or the transformers
  sampler. The loop is the README's (and docs/grpo.md's): ``generate`` -> score (``reward_of``, in this script) ->
  ``grpo_batch`` -> ``forward_backward`` and ``optim_step`` (both submitted before either is
  awaited) -> ``sync_weights``.
- ``trl``: TRL's ``GRPOTrainer`` in one process (generation with transformers ``generate``,
  TRL's default).

One worker stands for one device: plexrl's worker and its vLLM engine are pinned to the last
core (the coordinator and this script run beside it, unpinned), and TRL runs in a child process
(multiprocessing spawn) that calls ``os.sched_setaffinity(0, {last core})``, sets
``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` before torch is imported, as
``plexrl worker --cpus`` does.

Same work in every mode: the same prompts (drawn from ``--seed``; step i sees the same
``--prompts`` problems everywhere), ``--group`` completions each, every completion exactly
``--max-tokens`` tokens (plexrl ``SamplingParams(min_tokens=max_tokens)``, TRL
``generation_kwargs={"min_new_tokens": max_completion_length}``; each run checks the lengths it
got), temperature 1, no top-k / top-p, LoRA rank r (alpha 2r, dropout 0, q/k/v/o/gate/up/down),
AdamW at ``--lr`` with grad clip 1.0, no warmup or schedule, no KL term (plexrl ``kl_coef=0``,
TRL ``beta=0``), PPO clip 0.2 both sides, one optimizer step per GRPO step, the same reward
(``reward_of``: with it every row has an advantage, so plexrl's trainer skips none; it prints the share). The three modes
alternate within each repeat (vllm, hf, trl; ``--repeats`` times) so drift on a shared machine
hits them alike; every repeat is a fresh job / trainer.

Timing: seconds per step on this script's clock, each run's step 1 excluded (warm-up: the first
LoRA load, allocator growth), so each run contributes steps 2..N; the table gives the mean over
repeats of each run's mean, with min-max and std over repeats. plexrl's breakdown is
client-measured per call kind (``generate``, ``score`` = reward + batch building in the script,
``forward_backward``, ``optim_step``, ``sync_weights``). TRL's step is the time between
consecutive ``on_step_end`` callbacks; its ``generate`` is timed by wrapping the trainer's
``model.generate`` (the call inside ``_generate_single_turn``) and ``rest`` is the step minus
that (tokenizing, scoring, advantages, the forward/backward and the optimizer step).

TRL settings besides the shared ones: ``per_device_train_batch_size = generation_batch_size =
prompts x group`` and ``gradient_accumulation_steps=1`` (one generation and one optimizer step
per step, ``num_iterations=1``, so no extra old-logprob forward), ``shuffle_dataset=False`` (step
i's prompts in order), ``loss_type="dapo"`` (token mean over the batch, as plexrl's ``grpo``),
fp32 (``bf16=False``), ``gradient_checkpointing=False`` (TRL turns it on by default; plexrl does
not checkpoint, and it would only slow TRL down), ``use_cpu=True``; overhead plexrl does not
have is off: ``report_to="none"``, ``save_strategy="no"``, ``logging_steps`` past the last step,
``disable_tqdm=True``, ``log_completions=False``.

The last line is ``single_job_step_ratio_vs_trl=<x>``: plexrl's better sampler's mean seconds
per step over TRL's (target: <= 1.25).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `plexrl worker` does, before torch loads

import argparse
import asyncio
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.tasks import Problem, Task, get_task
from plexrl.text import Renderer
from plexrl.types import DEFAULT_LORA_TARGETS

TASK = "sum"
RENDERER = Renderer(CharTokenizer())
TARGET = 1.25
MODES = ("plexrl-vllm", "plexrl-hf", "trl")
PLEXRL_KINDS = ("generate", "score", "forward_backward", "optim_step", "sync_weights")


@dataclass
class Run:
    """One run of ``--steps`` GRPO steps: seconds per step (step 1 included) and per part of a step."""

    step_s: list[float] = field(default_factory=list)
    parts_s: dict[str, list[float]] = field(default_factory=dict)
    completion_lens: set[int] = field(default_factory=set)
    mean_reward: float = 0.0
    trained_rows: list[float] = field(default_factory=list)  # plexrl: the share of rows with an advantage

    def add(self, part: str, seconds: float) -> None:
        self.parts_s.setdefault(part, []).append(seconds)


def timed(per_step: list[float]) -> list[float]:
    """The steps that count: all but a run's first (warm-up)."""
    return per_step[1:]


def reward_of(task: Task, problem: Problem, completion: str) -> float:
    """The reward both loops give: the task's score plus the share of the completion's characters
    that are digits. Cut at exactly ``--max-tokens`` with EOS held back, nearly every completion
    scores 0 on the task alone; every group's advantages would then be 0, and plexrl's trainer
    skips such rows (they add nothing to the gradient) where TRL runs them. The digit share gives
    every group a spread, so both train on every row: the same work."""
    digits = sum(c.isdigit() for c in completion) / max(1, len(completion))
    return task.score(problem, completion) + digits


def draw_problems(args: argparse.Namespace) -> list[list[Problem]]:
    """Each step's problems, the same in every mode."""
    task, rng = get_task(TASK), np.random.default_rng(args.seed)
    return [task.sample(args.prompts, rng) for _ in range(args.steps)]


# -- plexrl -------------------------------------------------------------------------------------


async def plexrl_run(client: plexrl.Client, name: str, args: argparse.Namespace) -> Run:
    """``args.steps`` GRPO steps of a fresh LoRA job on ``client``'s cluster, every call timed."""
    task, run = get_task(TASK), Run()
    params = plexrl.SamplingParams(n=args.group, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    lora, adamw = plexrl.LoRA(rank=args.rank), plexrl.AdamW(lr=args.lr, grad_clip=1.0)
    rewards_all: list[float] = []
    async with plexrl.job(name, model=TINY_MODEL, lora=lora, optimizer=adamw, seed=args.seed, client=client) as job:
        for problems in draw_problems(args):
            prompts = [RENDERER.prompt(p.prompt) for p in problems]
            t0 = time.perf_counter()
            out = await job.generate(prompts, params)
            t1 = time.perf_counter()
            rewards = [reward_of(task, problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
            batch = plexrl.grpo_batch(prompts, out, rewards)
            run.trained_rows.append(float(np.mean(batch.advantages_B != 0)))
            t2 = time.perf_counter()
            fb, step = job.forward_backward(batch, loss="grpo"), job.optim_step()
            await fb
            t3 = time.perf_counter()
            await step
            t4 = time.perf_counter()
            await job.sync_weights()
            t5 = time.perf_counter()
            for part, seconds in zip(PLEXRL_KINDS, np.diff([t0, t1, t2, t3, t4, t5]), strict=True):
                run.add(part, float(seconds))
            run.step_s.append(t5 - t0)
            run.completion_lens.update(len(s.tokens) for s in out.samples)
            rewards_all.extend(rewards)
    run.mean_reward = float(np.mean(rewards_all))
    return run


# -- TRL (in a pinned child process) ------------------------------------------------------------


def pin_child(core: int) -> None:
    """The TRL child's initializer: one core and one torch thread, set before torch is imported."""
    assert "torch" not in sys.modules, "torch must load after pinning"
    os.sched_setaffinity(0, {core})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def trl_run(args: argparse.Namespace) -> Run:
    """``args.steps`` GRPO steps of a fresh ``GRPOTrainer``; runs in the pinned child process."""
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")  # TRL does not use vLLM here
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task, run = get_task(TASK), Run()
    problems = [p for step in draw_problems(args) for p in step]
    expected_prompts = {tuple(RENDERER.prompt(p.prompt)) for p in problems}
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    rewards_all: list[float] = []

    def reward(prompts: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any) -> list[float]:
        # Decoded as plexrl's loop decodes, so both score the same text.
        scores = [
            reward_of(task, Problem(prompt=p, answer=a), RENDERER.text(ids))
            for p, a, ids in zip(prompts, answer, completion_ids, strict=True)
        ]
        rewards_all.extend(scores)
        return scores

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            now = time.perf_counter()
            run.step_s.append(now - self.last)
            self.last = now

    out_dir = tempfile.mkdtemp(prefix="single-job-trl-")  # nothing is saved there (save_strategy="no")
    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        generation_batch_size=args.prompts * args.group,
        num_generations=args.group,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=args.max_tokens,
        generation_kwargs={"min_new_tokens": args.max_tokens},
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=args.steps + 1,
        disable_tqdm=True,
        log_completions=False,
    )
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=list(DEFAULT_LORA_TARGETS)
    )
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(TINY_MODEL),
        peft_config=lora,
        callbacks=[StepClock()],
    )
    inner, eos = trainer.model.generate, torch.tensor(trainer.eos_token_ids)

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        run.add("generate", time.perf_counter() - t0)
        input_ids, mask = kw["input_ids"], kw["attention_mask"]
        for row, m in zip(input_ids, mask, strict=True):  # TRL tokenizes prompts as plexrl's script does
            if tuple(row[m.bool()].tolist()) not in expected_prompts:
                raise RuntimeError(f"TRL's prompt ids {row[m.bool()].tolist()} are not CharTokenizer's")
        completions = out[:, input_ids.shape[1] :]
        ends = torch.isin(completions, eos)
        first_end = torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, completions.shape[1])
        run.completion_lens.update(first_end.tolist())
        return out

    trainer.model.generate = timed_generate
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training metrics into this bench's table
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if len(run.parts_s.get("generate", [])) != args.steps or len(run.step_s) != args.steps:
        raise RuntimeError("TRL did not generate once per step; the timing below would be wrong")
    run.parts_s["rest"] = [s - g for s, g in zip(run.step_s, run.parts_s["generate"], strict=True)]
    run.mean_reward = float(np.mean(rewards_all))
    return run


# -- the comparison -----------------------------------------------------------------------------


@dataclass
class Summary:
    mode: str
    per_repeat: list[float]  # each run's mean seconds per step (steps 2..N)
    parts: dict[str, float]  # seconds per step of each part, over all timed steps of all runs
    lens: set[int]
    reward: float
    trained_rows: list[float]

    @property
    def mean(self) -> float:
        return statistics.mean(self.per_repeat)


def summarize(mode: str, runs: list[Run]) -> Summary:
    """Per-repeat means of the timed steps, and each part's mean over all timed steps."""
    return Summary(
        mode=mode,
        per_repeat=[statistics.mean(timed(r.step_s)) for r in runs],
        parts={k: statistics.mean(x for r in runs for x in timed(r.parts_s[k])) for k in runs[0].parts_s},
        lens=set().union(*(r.completion_lens for r in runs)),
        reward=statistics.mean(r.mean_reward for r in runs),
        trained_rows=[x for r in runs for x in r.trained_rows],
    )


async def main(args: argparse.Namespace) -> None:
    last_core = max(os.sched_getaffinity(0))
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    t_start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=pin_child, initargs=(last_core,)) as trl_child:
        async with (
            plexrl.local(workers=1, cpus_per_worker=1, sampler="vllm", start_timeout_s=600) as vllm_client,
            plexrl.local(workers=1, cpus_per_worker=1, sampler="hf") as hf_client,
        ):
            clients = {"plexrl-vllm": vllm_client, "plexrl-hf": hf_client}
            loop = asyncio.get_running_loop()
            for r in range(args.repeats):
                for mode in MODES:
                    if mode == "trl":
                        run = await loop.run_in_executor(trl_child, trl_run, args)
                    else:
                        run = await plexrl_run(clients[mode], f"{mode}-{r}", args)
                    runs[mode].append(run)
                    counted = timed(run.step_s)
                    print(f"  repeat {r + 1}/{args.repeats} {mode:11}: {statistics.mean(counted):.3f} s/step "
                          f"(steps 2..{args.steps}: {' '.join(f'{s:.3f}' for s in counted)})", flush=True)  # fmt: skip
    summaries = [summarize(mode, rs) for mode, rs in runs.items()]
    report(summaries, args, time.perf_counter() - t_start)


def report(summaries: list[Summary], args: argparse.Namespace, wall_s: float) -> None:
    by_mode = {s.mode: s for s in summaries}
    trl = by_mode["trl"]
    print(f"\none LoRA GRPO job, task {TASK}: {args.prompts} prompts x group {args.group}, exactly {args.max_tokens} "
          f"tokens per completion, rank {args.rank}, lr {args.lr}; {args.steps} steps per run, steps 2..{args.steps} "
          f"timed, {args.repeats} repeats; one core for the worker / the TRL process")  # fmt: skip
    print(f"{'mode':12} {'s/step mean':>11} {'min':>7} {'max':>7} {'std':>7} {'vs trl':>7} "
          f"{'completion len':>14} {'mean reward':>11}")  # fmt: skip
    for s in summaries:
        std = statistics.stdev(s.per_repeat) if len(s.per_repeat) > 1 else 0.0
        lens = f"{min(s.lens)}..{max(s.lens)}"
        print(f"{s.mode:12} {s.mean:>11.3f} {min(s.per_repeat):>7.3f} {max(s.per_repeat):>7.3f} {std:>7.3f} "
              f"{s.mean / trl.mean:>7.3f} {lens:>14} {s.reward:>11.3f}")  # fmt: skip

    print("\nwhere a step's time goes (seconds per step, timed steps of all repeats)")
    columns = (*PLEXRL_KINDS, "rest")
    print(f"{'mode':12} " + " ".join(f"{k:>16}" for k in columns) + f" {'sum':>7}")
    for s in summaries:
        cells = [f"{s.parts[k]:>16.3f}" if k in s.parts else f"{'-':>16}" for k in columns]
        print(f"{s.mode:12} " + " ".join(cells) + f" {sum(s.parts.values()):>7.3f}")
    print("(plexrl: client-measured per call; trl: generate = its model.generate calls, rest = the rest of its "
          "step: tokenizing, scoring, advantages, forward/backward, optimizer step)")  # fmt: skip

    trained = [x for s in summaries for x in s.trained_rows]
    print(f"plexrl trained {min(trained):.3f}..{max(trained):.3f} of each step's rows (TRL trains every row; "
          "rows of advantage 0 are the ones plexrl skips)")  # fmt: skip
    full = all(s.lens == {args.max_tokens} for s in summaries)
    print(f"every completion exactly {args.max_tokens} tokens in every mode: {full}")
    best = min(by_mode["plexrl-vllm"], by_mode["plexrl-hf"], key=lambda s: s.mean)
    ratio = best.mean / trl.mean
    print(f"plexrl's best sampler: {best.mode}; ratio {ratio:.3f} (target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}); bench wall {wall_s:.0f} s")  # fmt: skip
    print(f"single_job_step_ratio_vs_trl={ratio:.3f}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run (step 1 is warm-up, not timed)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per completion (exactly: EOS is held back)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating between modes")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1 or args.group < 2:
        p.error("need --steps >= 2 (step 1 is not timed), --repeats >= 1 and --group >= 2 (GRPO)")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
