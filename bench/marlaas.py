"""MARLaaS: 32 RL tasks, each its own LoRA tenant of one base model, one at a time on one worker
against all 32 at once on it.

    python bench/marlaas.py [--tasks 32] [--steps 2] [--repeats 3] [--part both|real|sim] [--out bench-out/marlaas]

Tasks alternate between ``sum`` (worked sums of heavy-tailed length, ten to hundreds of tokens,
one turn) and the search agent (``plexrl.tasks.search``: up to 4 turns; each ``<search>`` goes to
BM25 over the shipped corpus behind a hosted search API's latency, drawn from
Lognormal(median ``--tool-median`` s, sigma ``--tool-sigma``)). Task i trains a LoRA adapter
of rank 2, 4 or 8 (in turn) with its own AdamW: ``--steps`` GRPO steps of ``--prompts`` x
``--group`` samples (a trajectory per sample for the agent; the agent's observation tokens are
masked out of the loss), then its held-out reward: greedy, on ``--eval`` held-out problems.
Each task is its own asyncio loop whose rollout, tools and training go at its own pace: no task
waits for another task's stage.

Two modes, each ``--repeats`` times; repetition r draws every problem, sampling seed and tool
latency from (r, task, step, sample, turn), the same in both modes:

- solo: the tasks one after another on one worker, each alone on the device;
- together: all tasks at once on the same worker (the ``--policy`` scheduler; a memory budget of
  ``--budget-jobs`` tasks' state, so adapters and optimizer states move to host memory and back).

The worker is pinned to one core (one worker stands for one device; bench/README.md); the client
and the coordinator run on the other. End-to-end time: solo = the sum of the tasks' walls, together
= the span from the first open to the last close. Accelerator utilization is the model FLOPs of
the work (every sampled sequence and every trained row counted once: 2 x params + attention per
token forward, training at 3x a forward) per device-second, as a share of the core's float32
matmul peak (measured on the worker's core before the run): what MFU is on a GPU. Compared modes
do the same work, so its gain is the inverse of the end-to-end time ratio. Beside it, two
time-based figures and their gains: the busy fraction (a call running) and the compute fraction
(core-seconds of the worker and its vLLM engine, from /proc, over wall seconds). Neither says how
much work a busy second did (on this CPU a decode step of 16 sequences costs a good part of what
one of 256 costs), so both gains are bounded by ``1 /`` their solo value. Limits beside the
reduction: the longest task's solo wall (together cannot end sooner: its critical path),
``1 - solo compute fraction`` (solo's core-seconds packed without a gap, without batching gains;
batching many tenants' generates in one vLLM engine beats it), and together's own core-seconds
without a gap (what a schedule could reach with the same compute; beyond it, together must
compute less). The table says whether every task sampled the same tokens in both modes (a digest
of every sampled token) and gives each task's final held-out reward in both.

(b) Simulated (``--part sim``, a second): the same mix at GPU scale on one H200 (Qwen3-1.7B, 64
rollouts a step, ``plexrl.sim``'s roofline costs), each task alone on a device vs all 32 on one.

Ends with ``utilization_gain=`` and ``e2e_time_reduction=`` (means over repetitions, the worst
repetition beside them).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import collections
import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

import plexrl
from plexrl.live import LiveView
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import completion, play, turn_params
from plexrl.sim import JobModel, Lognormal, Simulation
from plexrl.sim.costs import H200, QWEN3, grpo_job
from plexrl.tasks import Problem, Task, get_task
from plexrl.text import Renderer

RENDERER = Renderer(CharTokenizer())
KINDS = ("sum", "search")
RANKS = (2, 4, 8)
EVAL_KEY = 1 << 20  # the held-out evaluation's place among the steps in seeds


@dataclass(frozen=True)
class Spec:
    """One task of the benchmark."""

    index: int
    kind: str
    rank: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.index:02d}"


@dataclass
class Run:
    """One task's run as its client saw it."""

    spec: Spec
    start: float = 0.0
    end: float = 0.0
    sequences: list[int] = field(default_factory=list)  # length of every sampled sequence (a trajectory: its last)
    sampled_tokens: int = 0
    trained: list[int] = field(default_factory=list)  # length of every trained row
    turns: list[int] = field(default_factory=list)  # per training trajectory of the agent
    rewards: list[float] = field(default_factory=list)  # mean training reward per step
    final_reward: float = 0.0
    digest: Any = field(default_factory=hashlib.sha256)  # of every token it sampled, in order
    accelerator_s: float = 0.0
    swaps: int = 0
    state_bytes: int = 0  # its adapter, gradients and optimizer state

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def sampled(self, length: int, turns: list[np.ndarray]) -> None:
        """One sampled sequence: its whole length (prompt, turns, observations) and its turns' tokens."""
        self.sequences.append(length)
        for t in turns:
            self.sampled_tokens += len(t)
            self.digest.update(np.asarray(t, np.int32).tobytes() + b"|")


def specs(n: int) -> list[Spec]:
    return [Spec(i, KINDS[i % 2], RANKS[(i // 2) % len(RANKS)]) for i in range(n)]


def seed_of(*keys: int) -> int:
    """A sampling seed that depends only on ``keys`` (not on the order calls reach the sampler)."""
    return int(np.random.default_rng(list(keys)).integers(1 << 62))


class SearchAPI:
    """The search task's environment: BM25 over the corpus, behind a hosted search API's latency
    (the draws depend only on ``keys`` and the call's number in the trajectory)."""

    def __init__(self, task: Task, latency: Lognormal, keys: tuple[int, ...]) -> None:
        self.task, self.latency, self.keys = task, latency, keys
        self.calls = 0

    async def __call__(self, problem: Problem, response: str) -> str | None:
        observation = self.task.respond(problem, response)
        if observation is not None:
            self.calls += 1
            await asyncio.sleep(float(self.latency.draw(np.random.default_rng([*self.keys, self.calls]))))
        return observation


async def trajectories(
    job: plexrl.Job, task: Task, problems: list[Problem], copies: int, keys: tuple[int, ...], args: Any, greedy: bool
) -> list[plexrl.Trajectory]:
    """``copies`` agent trajectories per problem, all at once."""
    params = turn_params(task, RENDERER, temperature=0.0 if greedy else 1.0)
    latency = Lognormal(args.tool_median, args.tool_sigma)
    keyed = [(*keys, i, c) for i in range(len(problems)) for c in range(copies)]
    return list(await asyncio.gather(*(
        play(job, task, problems[k[-2]], params, RENDERER, tool=SearchAPI(task, latency, k), seed=seed_of(*k)) for k in keyed
    )))  # fmt: skip


async def rollout(
    job: plexrl.Job,
    task: Task,
    problems: list[Problem],
    copies: int,
    keys: tuple[int, ...],
    args: Any,
    run: Run,
    *,
    greedy: bool,
) -> tuple[list[float], Callable[[], plexrl.Batch]]:
    """``copies`` samples per problem (agent trajectories, or one generate of a single-turn task),
    recorded in ``run``: their rewards, and how to make their GRPO batch."""
    if task.turn_end is not None:
        trajs = await trajectories(job, task, problems, copies, keys, args, greedy)
        for t in trajs:
            run.sampled(len(t), [turn.tokens for turn in t.turns])
        if not greedy:
            run.turns += [len(t.turns) for t in trajs]
        rewards = [task.score(problems[i // copies], completion(t, RENDERER)) for i, t in enumerate(trajs)]
        groups = np.repeat(np.arange(len(problems)), copies)
        return rewards, functools.partial(plexrl.trajectory_batch, trajs, rewards, groups)
    prompts = [RENDERER.prompt(p.prompt) for p in problems]
    params = plexrl.SamplingParams(n=copies, max_tokens=task.max_tokens, temperature=0.0 if greedy else 1.0,
                                   seed=seed_of(*keys))  # fmt: skip
    out = await job.generate(prompts, params)
    for s in out.samples:
        run.sampled(len(prompts[s.prompt_index]) + len(s.tokens), [s.tokens])
    rewards = [task.score(problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
    return rewards, functools.partial(plexrl.grpo_batch, prompts, out, rewards)


async def task_run(spec: Spec, rep: int, args: Any, t0: float) -> Run:
    """One task, start to finish: ``args.steps`` GRPO steps, then its held-out reward."""
    task = get_task(spec.kind)
    run = Run(spec, start=time.perf_counter() - t0)
    rng = np.random.default_rng([rep, spec.index])
    lora, adamw = plexrl.LoRA(rank=spec.rank), plexrl.AdamW(lr=args.lr)
    async with plexrl.job(spec.name, model=TINY_MODEL, lora=lora, optimizer=adamw, seed=1000 * rep + spec.index) as job:
        for step in range(args.steps):
            problems, keys = task.sample(args.prompts, rng), (rep, spec.index, step)
            rewards, make_batch = await rollout(job, task, problems, args.group, keys, args, run, greedy=False)
            run.rewards.append(float(np.mean(rewards)))
            batch = make_batch()
            run.trained += [len(row) for row in batch.tokens]
            await job.optimize(batch, loss="grpo")
            await job.sync_weights()
        held, keys = task.eval_set()[: args.eval], (rep, spec.index, EVAL_KEY)  # greedy, tools as in training
        run.final_reward = float(np.mean((await rollout(job, task, held, 1, keys, args, run, greedy=True))[0]))
        stats = await job.stats()
    run.end = time.perf_counter() - t0
    run.accelerator_s, run.swaps, run.state_bytes = stats.accelerator_s, stats.swaps, stats.state_bytes
    return run


# -- the work in FLOPs, and the device's peak -------------------------------------------------------


@functools.cache
def model_shape() -> tuple[int, int]:
    """(matmul parameters per token, attention FLOPs per token per position before it)."""
    c = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    d, layers, ff, heads, kv = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], \
        c["num_attention_heads"], c["num_key_value_heads"]  # fmt: skip
    head = d // heads
    per_layer = d * heads * head + 2 * d * kv * head + heads * head * d + 3 * d * ff
    return layers * per_layer + d * c["vocab_size"], 4 * layers * heads * head


def forward_flops(lengths: list[int]) -> float:
    """A causal forward over whole sequences: 2 x params per token, plus attention over the prefix."""
    params, attention = model_shape()
    n = np.asarray(lengths, np.float64)
    return float(np.sum(2 * params * n + attention * n * (n - 1) / 2))


def work_flops(run: Run) -> float:
    """The model FLOPs of a task's work: its sampled sequences once, its trained rows at 3x a forward."""
    return forward_flops(run.sequences) + 3 * forward_flops(run.trained)


def matmul_peak(core: int) -> float:
    """Float32 matmul FLOP/s of one thread on ``core`` (the worker's), measured now."""
    import torch

    before = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        for _ in range(5):
            a @ b
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                a @ b
            best = min(best, time.perf_counter() - start)
        return 20 * 2 * 512**3 / best
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


# -- the two modes -----------------------------------------------------------------------------------


@dataclass
class Mode:
    """One repetition of one mode: every task's run and the device's view."""

    runs: list[Run]
    e2e_s: float
    used: Device

    @property
    def busy_fraction(self) -> float:
        return self.used.busy_s / self.e2e_s

    @property
    def compute_fraction(self) -> float:
        return self.used.cpu_s / self.e2e_s

    def utilization(self, peak: float) -> float:
        return sum(work_flops(r) for r in self.runs) / self.e2e_s / peak


def cluster(args: Any, budget: int | None) -> Any:
    return plexrl.local(workers=1, policy=args.policy, memory_budget_bytes=budget, cpus_per_worker=1,
                        sampler=args.sampler, max_loras=args.max_loras)  # fmt: skip


@dataclass(frozen=True)
class Device:
    """What the worker's device has done so far: time with a call running, and core-seconds computed."""

    busy_s: float
    cpu_s: float

    def __sub__(self, other: Device) -> Device:
        return Device(self.busy_s - other.busy_s, self.cpu_s - other.cpu_s)


async def device(client: plexrl.Client) -> Device:
    workers = (await client.status(min_workers=1)).workers
    return Device(sum(w.busy_s for w in workers), sum(cpu_seconds(w.pid) for w in workers))


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and every process below it (the worker and its vLLM engine), from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields_ = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended since
    return total


async def warm_up(args: Any) -> None:
    """Load the model and warm the engine (both kinds of task, one step), so no measured task pays for it."""
    warm = argparse.Namespace(**{**vars(args), "steps": 1, "eval": 2, "tool_median": 1e-3, "tool_sigma": 0.0})
    await asyncio.gather(*(task_run(s, 99, warm, time.perf_counter()) for s in specs(2)))


async def measure(args: Any) -> tuple[list[Mode], list[Mode], int]:
    tasks = specs(args.tasks)
    solo: list[Mode] = []
    view = LiveView(["solo", "together"], args.repeats * len(tasks), log_every=len(tasks) // 4 or 1)
    async with cluster(args, None) as client:
        await warm_up(args)
        for rep in range(args.repeats):
            before, runs = await device(client), []
            for spec in tasks:
                runs.append(await task_run(spec, rep, args, time.perf_counter()))
                view.update("solo", done=rep * len(tasks) + len(runs),
                            last=f"{spec.name} (rank {spec.rank}) {runs[-1].wall_s:.1f} s, held-out "
                                 f"{runs[-1].final_reward:.3f}")  # fmt: skip
            solo.append(Mode(runs, sum(r.wall_s for r in runs), await device(client) - before))
            view.update("solo", **{f"rep{rep + 1}": f"{solo[-1].e2e_s:.1f} s"})
    budget = int(args.budget_jobs * max(r.state_bytes for r in solo[0].runs))
    together: list[Mode] = []
    async with cluster(args, budget) as client:
        await warm_up(args)
        for rep in range(args.repeats):
            before, t0 = await device(client), time.perf_counter()
            runs = list(await asyncio.gather(*(task_run(spec, rep, args, t0) for spec in tasks)))
            span = max(r.end for r in runs) - min(r.start for r in runs)
            together.append(Mode(runs, span, await device(client) - before))
            view.update("together", done=(rep + 1) * len(tasks),
                        **{f"rep{rep + 1}": f"{span:.1f} s ({sum(r.swaps for r in runs)} swaps)"})  # fmt: skip
    return solo, together, budget


# -- (b) the same mix simulated on an H200 ------------------------------------------------------------


def sim_jobs(args: Any) -> list[JobModel]:
    """The real part's mix at GPU scale: LoRA GRPO tasks on Qwen3-1.7B, 64 rollouts a step; a
    reasoning task is one turn of heavy-tailed length, an agent three turns with the real part's
    search latency."""
    llm = QWEN3["1.7B"]
    tools = Lognormal(args.tool_median, args.tool_sigma)
    reasoning = grpo_job("sum", llm, steps=args.sim_steps, turns=1, output_tokens=Lognormal(1024.0, 0.8),
                         tool_latency_s=Lognormal(1e-3, 0.0), lora_rank=8)  # fmt: skip
    agent = grpo_job("search", llm, steps=args.sim_steps, turns=3, output_tokens=Lognormal(128.0, 0.5),
                     tool_latency_s=tools, lora_rank=8)  # fmt: skip
    return [(reasoning, agent)[s.index % 2] for s in specs(args.tasks)]


def sim_part(args: Any) -> list[tuple[float, float, float, float]]:
    """Per seed: (solo e2e s, together e2e s, solo busy fraction, together busy fraction)."""
    jobs = sim_jobs(args)
    memory = H200.memory_bytes - QWEN3["1.7B"].weight_bytes
    rows = []
    for seed in range(args.repeats):
        alone = Simulation("dedicated", len(jobs), jobs, seed=seed).run()  # each task alone on a device
        shared = Simulation(args.policy, 1, jobs, seed=seed, slots=len(jobs), memory_bytes=memory,
                            swap_bytes_per_s=H200.host_bytes_per_s).run()  # fmt: skip
        rows.append((sum(j.wall_s for j in alone.jobs), shared.end_s, alone.busy_fraction, shared.busy_fraction))
    return rows


def sim_report(args: Any, rows: list[tuple[float, float, float, float]]) -> None:
    solo, together, busy_solo, busy_together = (list(x) for x in zip(*rows, strict=True))
    reduction = [1 - t / s for s, t in zip(solo, together, strict=True)]
    print(f"\n(b) simulated: the same mix on one {H200.name} (Qwen3-1.7B, LoRA rank 8, {args.sim_steps} steps of 64 "
          f"rollouts; reasoning: 1 turn of Lognormal(1024, 0.8) tokens; agent: 3 turns of Lognormal(128, 0.5), "
          f"search Lognormal({args.tool_median}, {args.tool_sigma}) s), seeds 0-{args.repeats - 1}")  # fmt: skip
    print(f"  solo: {spread(solo, 0)} s, busy {spread(busy_solo)}; together: {spread(together, 0)} s, busy "
          f"{spread(busy_together)}; end-to-end reduction {spread(reduction)}; busy-time gain "
          f"{spread([t / s for s, t in zip(busy_solo, busy_together, strict=True)], 2)}")  # fmt: skip


# -- the report --------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def report(args: Any, solo: list[Mode], together: list[Mode], budget: int, peak: float) -> dict[str, str]:
    lengths = np.array([n for m in solo for r in m.runs if r.spec.kind == "sum" for n in r.sequences])
    turns = collections.Counter(t for m in solo for r in m.runs for t in r.turns)
    waits = Lognormal(args.tool_median, args.tool_sigma)
    print(f"\n{args.tasks} tasks ({', '.join(KINDS)} in turn; LoRA ranks {'/'.join(map(str, RANKS))}), "
          f"{args.steps} GRPO steps of {args.prompts} x {args.group} samples, held-out on {args.eval} problems; "
          f"{args.repeats} repetitions, mean [min-max]; sampler {args.sampler}, policy {args.policy}, "
          f"budget {budget / 2**20:.1f} MiB ({args.budget_jobs:g} tasks' state)")  # fmt: skip
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"  sum: sequence lengths p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()} tokens; "
          f"agent: turns per trajectory {dict(sorted(turns.items()))}, search latency Lognormal(median "
          f"{waits.median} s, sigma {waits.sigma})")  # fmt: skip
    print(f"  device peak (float32 matmul, one thread on the worker's core): {peak / 1e9:.1f} GFLOP/s")
    print(f"  {'mode':>8} | {'end-to-end s':>20} | {'busy (a call running)':>21} | {'compute (core-s / s)':>20} | "
          f"{'model FLOPs, % of peak':>22} | {'swaps':>5}")  # fmt: skip
    for name, modes in (("solo", solo), ("together", together)):
        print(f"  {name:>8} | {spread([m.e2e_s for m in modes], 1):>20} | {spread([m.busy_fraction for m in modes]):>21} | "
              f"{spread([m.compute_fraction for m in modes]):>20} | {spread([100 * m.utilization(peak) for m in modes], 3):>22} | "
              f"{statistics.mean(sum(r.swaps for r in m.runs) for m in modes):>5.0f}")  # fmt: skip
    pairs = list(zip(solo, together, strict=True))
    reduction = [1 - t.e2e_s / s.e2e_s for s, t in pairs]
    gain = [t.utilization(peak) / s.utilization(peak) for s, t in pairs]  # model FLOPs per device-second
    compute_gain = [t.compute_fraction / s.compute_fraction for s, t in pairs]
    busy_gain = [t.busy_fraction / s.busy_fraction for s, t in pairs]
    packed = [1 - s.compute_fraction for s in solo]
    critical = [1 - max(r.wall_s for r in s.runs) / s.e2e_s for s in solo]
    gapless = [1 - t.used.cpu_s / s.e2e_s for s, t in pairs]
    print(f"  end-to-end reduction {spread(reduction)}; limits: {spread(critical)} if together took only the longest "
          f"task's solo wall (its critical path), {spread(packed)} if solo's core-seconds were packed without a gap "
          f"and without batching gains (1 - solo compute fraction), {spread(gapless)} if together's own core-seconds "
          f"ran without a gap (what scheduling alone can reach at together's compute)")  # fmt: skip
    print(f"  utilization gain (model FLOPs per device-second) {spread(gain, 2)}; compute-fraction gain "
          f"{spread(compute_gain, 2)} (at most {1 / max(s.compute_fraction for s in solo):.2f}); busy-time gain "
          f"{spread(busy_gain, 2)}")  # fmt: skip
    identical = [all(a.digest.digest() == b.digest.digest() for a, b in zip(s.runs, t.runs, strict=True))
                 for s, t in zip(solo, together, strict=True)]  # fmt: skip
    print(f"  every task sampled the same tokens in both modes: {' '.join(map(str, identical))} (per repetition)")
    print(f"\n  {'task':>8} {'rank':>4} | {'solo held-out':>20} | {'together held-out':>20} | within solo spread")
    within = []
    for i, spec in enumerate(specs(args.tasks)):
        a = [m.runs[i].final_reward for m in solo]
        b = [m.runs[i].final_reward for m in together]
        ok = all(min(a) - 1e-9 <= x <= max(a) + 1e-9 for x in b)
        within.append(ok)
        print(f"  {spec.name:>8} {spec.rank:>4} | {spread(a):>20} | {spread(b):>20} | {ok}")
    print(f"  tasks whose together rewards lie within their solo spread: {sum(within)}/{len(within)}")
    return {
        "utilization_gain": f"{statistics.mean(gain):.2f} (worst {min(gain):.2f}; target >= 4.3)",
        "e2e_time_reduction": f"{statistics.mean(reduction):.3f} (worst {min(reduction):.3f}; target >= 0.85)",
    }


def save(out: Path, solo: list[Mode], together: list[Mode]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {"mode": name, "repetition": rep, "e2e_s": m.e2e_s, "busy_s": m.used.busy_s, "cpu_s": m.used.cpu_s,
         "runs": [{**{f.name: getattr(r, f.name) for f in fields(r) if f.name != "digest"}, "digest": r.digest.hexdigest()}
                  for r in m.runs]}
        for name, modes in (("solo", solo), ("together", together)) for rep, m in enumerate(modes)
    ]  # fmt: skip
    path = out / "marlaas.json"
    path.write_text(json.dumps(rows, default=str))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per task")
    parser.add_argument("--prompts", type=int, default=2, help="problems per step")
    parser.add_argument("--group", type=int, default=8, help="samples per problem (a GRPO group)")
    parser.add_argument("--eval", type=int, default=16, help="held-out problems per task")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--tool-median", type=float, default=1.0, help="search latency's median, seconds")
    parser.add_argument("--tool-sigma", type=float, default=0.7, help="search latency's log-space spread")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-jobs", type=float, default=8, help="together: the device budget, in tasks' state")
    parser.add_argument("--policy", choices=["fifo", "plex"], default="plex")
    parser.add_argument("--max-loras", type=int, default=32, help="vLLM: adapters one batch may mix")
    parser.add_argument("--sampler", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--out", default="bench-out/marlaas")
    parser.add_argument("--sim-steps", type=int, default=10, help="(b) GRPO steps per simulated task")
    parser.add_argument("--part", choices=["both", "real", "sim"], default="both")
    args = parser.parse_args()
    finals: dict[str, str] = {}
    if args.part in ("both", "real"):
        print(f"(a) {args.tasks} tasks solo, then together, on one worker ({args.repeats} repetitions)", flush=True)
        peak = matmul_peak(max(os.sched_getaffinity(0)))
        solo, together, budget = asyncio.run(measure(args))
        finals = report(args, solo, together, budget, peak)
        print(f"raw runs: {save(Path(args.out), solo, together)}")
    if args.part in ("both", "sim"):
        sim_report(args, sim_part(args))
    for key, value in finals.items():
        print(f"{key}={value}")


if __name__ == "__main__":
    main()
