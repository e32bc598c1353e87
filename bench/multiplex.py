"""Agentic GRPO jobs on dedicated devices against the same jobs sharing one device under ``fifo``
and under ``plex``: (a) for real on this machine, in two regimes; (b) simulated on a cluster.

    python bench/multiplex.py [--jobs 4] [--repeats 3] [--part both|real|sim] [--out bench-out/multiplex]

(a) Real. K LoRA GRPO jobs on the shipped tiny model, task ``sum`` (worked solutions of
heavy-tailed length), on the vLLM sampler (``--sampler hf`` for transformers). A step is
``turns`` rounds of a ``generate`` (prompts x group samples, up to the task's 400 tokens)
followed by a tool call off the accelerator (a wait drawn from a lognormal, the same draws in
every mode), then ``forward_backward`` on every turn's samples, ``optim_step`` and
``sync_weights``. Three modes, each ``--repeats`` times:

- dedicated: every job alone on a worker of its own (a device held for its whole wall time);
- fifo: all K jobs at once on one worker, oldest call first, state moved in and out on demand;
- plex: the same on one worker under plexrl's ``plex`` policy.

fifo and plex run with the same device budget, which holds the state of fewer jobs than there
are, so state moves for real. Two regimes: ``light`` (the tools dominate: every job alone keeps
its device busy a small fraction of the time, so any sharing wins) and ``contended`` (every job
alone keeps its device busy at least 30% of the time, so sharing must be scheduled well). Each
worker is pinned to a core of its own (bench/README.md). GPU-hours: dedicated = the sum of the
jobs' walls; shared = the span of the shared run (one device from the first open to the last
close). The limit beside each reduction is the ideal one, ``1 - mean busy fraction`` of the
dedicated runs (every job's device-seconds packed without a gap and without batching gains);
batching same-base generates in one engine can beat it. Every mode samples the same tokens if
scheduling does not change what a job computes: the table says whether every job's digest of
sampled tokens matched its dedicated run.

Calibration. The dedicated runs' call times and output lengths define a ``JobModel`` per job
(a generate's time fitted as a per-step cost that batched jobs share plus a per-token cost);
the simulator predicts the shared plex run of the contended regime from them, printed next to
the measurement.

(b) Simulated. 32 LoRA GRPO jobs on Qwen3 1.7B/4B/8B (``plexrl.sim.costs``: roofline cost
models of an H200; 3 turns with tools of median 8 s, 20 steps, one job arriving every 20 s),
seeds 0-2: ``dedicated`` (a rollout GPU and a trainer GPU per job, simulated as a
disaggregated synchronous job on two devices of its own), ``colocated-sync`` (one GPU per job),
and ``fifo`` and ``plex`` over a sweep of pool sizes. A single operating point can mislead, so
the sweep prints GPU-hours against median slowdown (vs colocated-sync) for both and plots the
frontier; each policy is compared at its best point with median slowdown <= 1.3x. Then a
memory-bound pool: 8 jobs of 30 GB state on 2 devices of 80 GB, tools of median 1 s; and a pool
with a job larger than one device: a Qwen3-8B full fine-tune on a gang of 2 GPUs (FSDP2 trainer,
tensor-parallel sampler: ``sim/costs.py``'s ``group_job``, the gang costs ``bench/sim_scale.py``
and the scheduler's group placement use) beside the first 14 of the LoRA jobs on one node of 8
GPUs, against each job on devices of its own.

Ends with ``gpu_hour_reduction_real=`` (plex vs dedicated, contended), ``gpu_hour_reduction_sim=``
and ``gpu_hour_reduction_sim_vs_colocated=`` (plex at its best point), and
``plex_vs_fifo_slowdown=`` (plex's median slowdown over fifo's, contended, same budget).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.protocol.messages import JobInfo
from plexrl.sim import JobModel, Lognormal, SimResult, Simulation
from plexrl.sim.costs import H200, QWEN3, group_job, grpo_job
from plexrl.tasks import get_task
from plexrl.text import Renderer
from plexrl.trace import chrome_trace

TASK = get_task("sum")
RENDERER = Renderer(CharTokenizer())
SIM_SIZES = ("1.7B", "4B", "8B")
MAX_SLOWDOWN = 1.3  # the operating points compared: median slowdown at most this
MODES = ("dedicated", "fifo", "plex")


@dataclass(frozen=True)
class Regime:
    name: str
    prompts: int  # per generate call
    group: int  # samples per prompt
    turns: int  # generate + tool rounds per step
    steps: int
    tool: Lognormal  # seconds
    budget_jobs: float  # the shared device's budget, in jobs' state


REGIMES = (
    # Tool-bound: every job alone keeps its device busy a small fraction of the time.
    Regime("light", prompts=2, group=8, turns=2, steps=2, tool=Lognormal(6.0, 0.5), budget_jobs=2.5),
    # Every job alone keeps its device busy at least 30% of the time (seen: 0.31-0.46), so four
    # of them load one device more than fully unless their generates batch.
    Regime("contended", prompts=2, group=8, turns=3, steps=2, tool=Lognormal(2.0, 0.5), budget_jobs=2.5),
)


@dataclass
class Trace:
    """One job's run as its client saw it (seconds since the run began)."""

    name: str
    start: float = 0.0
    end: float = 0.0
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, submitted, answered)
    lengths: list[int] = field(default_factory=list)  # completion lengths
    gen_steps: list[int] = field(default_factory=list)  # per generate: its longest completion
    gen_tokens: list[int] = field(default_factory=list)  # per generate: tokens it sampled
    tokens: list[int] = field(default_factory=list)  # per forward_backward: tokens trained
    samples: Any = field(default_factory=hashlib.sha256)  # digest of every token it sampled, in order
    stats: JobInfo | None = None

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def busy_fraction(self) -> float:
        return self.stats.accelerator_s / self.wall_s if self.stats else 0.0

    def seconds(self, kind: str) -> list[float]:
        return [b - a for k, a, b in self.calls if k == kind]


@dataclass
class Shared:
    """One shared run (fifo or plex) of every job."""

    traces: list[Trace]
    span_s: float


async def agent(index: int, regime: Regime, args: argparse.Namespace, t0: float) -> Trace:
    """One agentic GRPO job; its draws (problems, tool waits) depend only on ``index``."""
    trace = Trace(f"{TASK.name}{index}")
    rng = np.random.default_rng(1000 + index)
    sampling = plexrl.SamplingParams(n=regime.group, max_tokens=TASK.max_tokens, temperature=1.0)
    clock = time.perf_counter

    async def timed(kind: str, call):  # type: ignore[no-untyped-def]
        submitted = clock() - t0
        result = await call
        trace.calls.append((kind, submitted, clock() - t0))
        return result

    trace.start = clock() - t0
    lora, adamw = plexrl.LoRA(rank=8), plexrl.AdamW(lr=1e-3)
    async with plexrl.job(trace.name, model=TINY_MODEL, lora=lora, optimizer=adamw, seed=index) as job:
        for _ in range(regime.steps):
            batches = []
            for _ in range(regime.turns):
                problems = TASK.sample(regime.prompts, rng)
                prompts = [RENDERER.prompt(p.prompt) for p in problems]
                out = await timed("generate", job.generate(prompts, sampling))
                lengths = [len(s.tokens) for s in out.samples]
                for s in out.samples:
                    trace.samples.update(np.asarray(s.tokens, np.int32).tobytes() + b"|")
                trace.lengths += lengths
                trace.gen_steps.append(max(lengths))
                trace.gen_tokens.append(sum(lengths))
                rewards = [TASK.score(problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
                batches.append(plexrl.grpo_batch(prompts, out, rewards))
                await asyncio.sleep(float(regime.tool.draw(rng)))  # the tool: off the accelerator
            for batch in batches:
                fb = await timed("forward_backward", job.forward_backward(batch))
                trace.tokens.append(fb.num_tokens)
            await timed("optim_step", job.optim_step())
            await timed("sync_weights", job.sync_weights())
        trace.stats = await job.stats()
    trace.end = clock() - t0
    return trace


def cluster(args: argparse.Namespace, policy: str, budget: int | None = None) -> Any:
    return plexrl.local(workers=1, policy=policy, memory_budget_bytes=budget, cpus_per_worker=1, sampler=args.sampler)


async def warm_up(regime: Regime, args: argparse.Namespace) -> None:
    """Load the model and warm the engines on the worker, so no measured job pays for it."""
    warm = dataclasses.replace(regime, steps=1, turns=1, tool=Lognormal(1e-3, 0.0))
    await agent(99, warm, args, time.perf_counter())


async def real_regime(regime: Regime, args: argparse.Namespace) -> tuple[list[list[Trace]], dict[str, list[Shared]]]:
    """``args.repeats`` runs of every mode: dedicated traces per repetition and the shared runs."""
    print(f"(a) {regime.name}: {args.jobs} jobs x {regime.steps} steps x {regime.turns} turns of "
          f"{regime.prompts} x {regime.group} samples, tools ~ Lognormal(median {regime.tool.median} s, "
          f"sigma {regime.tool.sigma})", flush=True)  # fmt: skip
    alone: list[list[Trace]] = []
    async with cluster(args, "dedicated"):
        await warm_up(regime, args)
        for rep in range(args.repeats):
            alone.append([await agent(i, regime, args, time.perf_counter()) for i in range(args.jobs)])
            walls = " ".join(f"{t.wall_s:.1f}" for t in alone[-1])
            print(f"  dedicated, repetition {rep + 1}: walls {walls} s", flush=True)
    state = alone[0][0].stats.state_bytes if alone[0][0].stats else 0
    budget = int(regime.budget_jobs * state)
    shared: dict[str, list[Shared]] = {}
    for policy in ("fifo", "plex"):
        shared[policy] = []
        async with cluster(args, policy, budget):
            await warm_up(regime, args)
            for rep in range(args.repeats):
                t0 = time.perf_counter()
                traces = list(await asyncio.gather(*(agent(i, regime, args, t0) for i in range(args.jobs))))
                span = max(t.end for t in traces) - min(t.start for t in traces)
                shared[policy].append(Shared(traces, span))
                print(f"  {policy}, repetition {rep + 1}: span {span:.1f} s (budget {budget} B)", flush=True)
    return alone, shared


@dataclass(frozen=True)
class Outcome:
    """One mode of one repetition, against that repetition's dedicated runs."""

    device_s: float
    reduction: float
    median_slowdown: float
    max_slowdown: float
    swaps: int
    identical: bool


def outcome(alone: list[Trace], run: Shared | None) -> Outcome:
    dedicated = sum(t.wall_s for t in alone)
    if run is None:
        return Outcome(dedicated, 0.0, 1.0, 1.0, 0, True)
    slow = [s.wall_s / a.wall_s for a, s in zip(alone, run.traces, strict=True)]
    return Outcome(
        device_s=run.span_s,
        reduction=1 - run.span_s / dedicated,
        median_slowdown=statistics.median(slow),
        max_slowdown=max(slow),
        swaps=sum(t.stats.swaps for t in run.traces if t.stats),
        identical=all(a.samples.digest() == s.samples.digest() for a, s in zip(alone, run.traces, strict=True)),
    )


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def real_table(regime: Regime, alone: list[list[Trace]], shared: dict[str, list[Shared]]) -> dict[str, list[Outcome]]:
    busy = [sum(t.stats.accelerator_s for t in a if t.stats) / sum(t.wall_s for t in a) for a in alone]
    limit = 1 - statistics.mean(busy)
    lengths = np.array([n for a in alone for t in a for n in t.lengths])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    per_job = [statistics.mean(t.busy_fraction for t in a) for a in zip(*alone, strict=True)]
    print(f"\n(a) real, {regime.name}: {len(alone[0])} jobs, {len(alone)} repetitions, mean [min-max]")
    print(f"  sampled lengths: p50 {p50:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()} tokens")
    print(f"  busy fraction of each job alone: {' '.join(f'{b:.2f}' for b in per_job)}; limit (ideal reduction) "
          f"1 - mean busy = {limit:.3f}")  # fmt: skip
    print(f"  {'mode':>9} | {'device-s':>20} | {'reduction':>20} | {'of limit':>6} | {'median slowdown':>20} | "
          f"{'max slowdown':>20} | {'swaps':>5} | identical samples")  # fmt: skip
    outcomes: dict[str, list[Outcome]] = {}
    for mode in MODES:
        runs = [None] * len(alone) if mode == "dedicated" else shared[mode]
        outcomes[mode] = [outcome(a, r) for a, r in zip(alone, runs, strict=True)]
        o = outcomes[mode]
        reduction = statistics.mean(x.reduction for x in o)
        print(f"  {mode:>9} | {spread([x.device_s for x in o], 1):>20} | {spread([x.reduction for x in o]):>20} | "
              f"{reduction / limit:>6.2f} | {spread([x.median_slowdown for x in o]):>20} | "
              f"{spread([x.max_slowdown for x in o]):>20} | {statistics.mean(x.swaps for x in o):>5.0f} | "
              f"{all(x.identical for x in o)}")  # fmt: skip
    return outcomes


def calibrated(trace: Trace, regime: Regime, state_bytes: int) -> JobModel:
    """The simulator's model of a job, from its run alone (see the module docstring).

    A generate's time is fitted as ``a * decode steps + b * tokens`` over the job's generates: ``a``
    is what a decode step costs whatever it holds (reading the weights, the engine's own step),
    which same-base generates batched together share; ``b`` is each sequence's own part.
    """
    logs = np.log(np.maximum(1, trace.lengths))
    design = np.array([trace.gen_steps, trace.gen_tokens], dtype=float).T
    (a, b), *_ = np.linalg.lstsq(design, np.array(trace.seconds("generate")), rcond=None)
    a, b = max(a, 0.0), max(b, 0.0)
    active = float(np.mean(np.array(trace.gen_tokens) / np.array(trace.gen_steps)))
    return JobModel(
        trace.name,
        steps=regime.steps,
        rollouts=regime.prompts * regime.group,
        turns=regime.turns,
        output_tokens=Lognormal(float(np.exp(np.median(logs))), float(np.std(logs))),
        decode_step_s=a + b * active,
        shared_step_fraction=a / (a + b * active) if a + b * active > 0 else 0.0,
        tool_latency_s=regime.tool,
        train_s_per_token=sum(trace.seconds("forward_backward")) / sum(trace.tokens),
        optim_step_s=statistics.mean(trace.seconds("optim_step")),
        sync_s=statistics.mean(trace.seconds("sync_weights")),
        state_bytes=state_bytes,
        base="tiny",
    )


def calibration(regime: Regime, alone: list[Trace], plex: Shared, outcome_: Outcome, sampler: str) -> None:
    state = alone[0].stats.state_bytes if alone[0].stats else 0
    models = [calibrated(t, regime, state) for t in alone]
    slots = 64 if sampler == "vllm" else 1  # what the worker registers
    moved = sum(t.stats.swap_bytes for t in plex.traces if t.stats)
    moving = sum(t.stats.swap_s for t in plex.traces if t.stats)
    bandwidth = moved / moving if moving else 1e9
    sim_alone = Simulation("dedicated", len(models), models, seed=1).run()
    sim_plex = Simulation(
        "plex", 1, models, seed=1, slots=slots, memory_bytes=regime.budget_jobs * state, swap_bytes_per_s=bandwidth
    ).run()
    sim_slow = [p.wall_s / d.wall_s for p, d in zip(sim_plex.jobs, sim_alone.jobs, strict=True)]
    print(f"  calibration ({regime.name}, repetition 1): the simulator fed the dedicated runs' models predicts plex")
    print(f"  {'':>22} {'measured':>9} {'simulated':>9}")
    print(f"  {'wall alone, mean (s)':>22} {statistics.mean(t.wall_s for t in alone):>9.2f} "
          f"{statistics.mean(j.wall_s for j in sim_alone.jobs):>9.2f}")  # fmt: skip
    print(f"  {'median slowdown':>22} {outcome_.median_slowdown:>9.2f} {statistics.median(sim_slow):>9.2f}")
    print(f"  {'GPU-hour reduction':>22} {outcome_.reduction:>9.3f} "
          f"{1 - sim_plex.device_hours / sim_alone.device_hours:>9.3f}")  # fmt: skip


# -- (b) simulated ----------------------------------------------------------------------------


def sim_jobs(args: argparse.Namespace) -> list[JobModel]:
    return [
        grpo_job(SIM_SIZES[i % 3], QWEN3[SIM_SIZES[i % 3]], steps=args.sim_steps, arrival_s=20.0 * i)
        for i in range(args.sim_jobs)
    ]


@dataclass(frozen=True)
class Point:
    devices: int
    hours: float
    median_slowdown: float
    max_slowdown: float
    used: int


def slowdowns(result: SimResult, baseline: SimResult) -> list[float]:
    return [r.wall_s / c.wall_s for r, c in zip(result.jobs, baseline.jobs, strict=True)]


def sweep(policy: str, jobs: list[JobModel], seed: int, colocated: SimResult, devices: list[int]) -> list[Point]:
    memory = H200.memory_bytes - sum(QWEN3[s].weight_bytes for s in SIM_SIZES)  # every base may be loaded
    points = []
    for n in devices:
        result = Simulation(
            policy, n, jobs, seed=seed, slots=3, memory_bytes=memory, swap_bytes_per_s=H200.host_bytes_per_s
        ).run()
        slow = slowdowns(result, colocated)
        points.append(Point(n, result.device_hours, statistics.median(slow), max(slow), len(result.held_s)))
    return points


def best(points: list[Point]) -> Point:
    """The cheapest point within the slowdown bound (the one with the least slowdown if none is)."""
    within = [p for p in points if p.median_slowdown <= MAX_SLOWDOWN]
    return min(within, key=lambda p: p.hours) if within else min(points, key=lambda p: p.median_slowdown)


def sim_part(args: argparse.Namespace) -> tuple[float, float, dict[str, list[Point]], SimResult | None]:
    jobs = sim_jobs(args)
    devices = list(range(args.sim_min_devices, args.sim_jobs + 1))
    t = time.perf_counter()
    rows: dict[str, list[float]] = {k: [] for k in ("dedicated", "colocated-sync", "fifo", "plex")}
    slow: dict[str, list[float]] = {k: [] for k in rows}
    frontier: dict[str, list[Point]] = {}
    timeline = None
    for seed in range(args.repeats):
        colocated = Simulation("dedicated", len(jobs), jobs, seed=seed).run()
        split = [dataclasses.replace(j, disaggregated=True) for j in jobs]
        dedicated = Simulation("dedicated", 2 * len(jobs), split, seed=seed).run()
        rows["dedicated"].append(dedicated.device_hours)
        rows["colocated-sync"].append(colocated.device_hours)
        slow["dedicated"].append(statistics.median(slowdowns(dedicated, colocated)))
        slow["colocated-sync"].append(1.0)
        for policy in ("fifo", "plex"):
            points = sweep(policy, jobs, seed, colocated, devices)
            if seed == 0:
                frontier[policy] = points
            b = best(points)
            rows[policy].append(b.hours)
            slow[policy].append(b.median_slowdown)
            if seed == 0 and policy == "plex":
                memory = H200.memory_bytes - sum(QWEN3[s].weight_bytes for s in SIM_SIZES)
                timeline = Simulation(
                    "plex", b.devices, jobs, seed=0, slots=3, memory_bytes=memory,
                    swap_bytes_per_s=H200.host_bytes_per_s, record_timeline=True,
                ).run()  # fmt: skip
    print(f"\n(b) simulated ({time.perf_counter() - t:.0f} s): {args.sim_jobs} LoRA GRPO jobs (Qwen3 "
          f"{'/'.join(SIM_SIZES)}) on {H200.name}s, seeds 0-{args.repeats - 1}, mean [min-max]")  # fmt: skip
    print("  frontier, seed 0 (devices: GPU-hours / median slowdown vs colocated-sync):")
    for policy, points in frontier.items():
        print(f"  {policy:>5} " + "  ".join(f"{p.devices}:{p.hours:.2f}/{p.median_slowdown:.2f}" for p in points))
    base, colo = statistics.mean(rows["dedicated"]), statistics.mean(rows["colocated-sync"])
    print(
        f"  {'policy':>15} | {'GPU-hours':>20} | {'median slowdown':>20} | {'vs dedicated':>12} | {'vs colocated':>12}"
    )
    for name, hours in rows.items():
        h = statistics.mean(hours)
        print(f"  {name:>15} | {spread(hours, 2):>20} | {spread(slow[name], 2):>20} | {1 - h / base:>12.3f} | "
              f"{1 - h / colo:>12.3f}")  # fmt: skip
    print(f"  fifo and plex at their best point with median slowdown <= {MAX_SLOWDOWN}x (a pool size per seed); "
          "dedicated: a rollout and a trainer GPU per job")  # fmt: skip
    memory_bound()
    gang_pool(args)
    plex = statistics.mean(rows["plex"])
    return 1 - plex / base, 1 - plex / colo, frontier, timeline


def memory_bound() -> None:
    """8 jobs of 30 GB on 2 devices of 80 GB, tools of median 1 s: two jobs' state fit per device."""
    jobs = [JobModel("agent", steps=6, turns=3, tool_latency_s=Lognormal(1.0, 0.5), state_bytes=30 * 10**9)] * 8
    alone = Simulation("dedicated", len(jobs), jobs, seed=0).run()
    print("  memory-bound pool: 8 jobs of 30 GB state on 2 devices of 80 GB (tools median 1 s), seed 0")
    for policy in ("fifo", "plex"):
        result = Simulation(policy, 2, jobs, seed=0, memory_bytes=80e9, swap_bytes_per_s=H200.host_bytes_per_s).run()
        s = slowdowns(result, alone)
        print(f"  {policy:>5}: GPU-hours {result.device_hours:.2f}, median slowdown {statistics.median(s):.2f}x "
              f"(max {max(s):.2f}x), swaps {result.swaps}")  # fmt: skip


def gang_pool(args: argparse.Namespace) -> None:
    """A Qwen3-8B full fine-tune on a gang of 2 GPUs (145 GB of state: no one GPU holds it) beside
    14 LoRA jobs on one node of 8 H200s, seed 0: its gang time-sliced with them (fifo, plex),
    against every job on devices of its own (the gang's 2, one each for the others)."""
    gang = group_job("fsdp2-8B", QWEN3["8B"], 2, steps=args.sim_steps, turns=3)
    jobs = [gang, *sim_jobs(args)[:14]]
    alone = Simulation("dedicated", 2 + len(jobs) - 1, jobs, seed=0).run()
    memory = H200.memory_bytes - sum(QWEN3[s].weight_bytes for s in SIM_SIZES)
    print(f"  a gang in the pool: {gang.name} on 2 GPUs ({gang.state_bytes / 1e9:.0f} GB of state each) and 14 "
          f"LoRA jobs on 8 GPUs, seed 0 (alone: {alone.device_hours:.2f} GPU-hours on {2 + len(jobs) - 1})")  # fmt: skip
    for policy in ("fifo", "plex"):
        result = Simulation(policy, 8, jobs, seed=0, slots=3, memory_bytes=memory,
                            swap_bytes_per_s=H200.host_bytes_per_s).run()  # fmt: skip
        s = slowdowns(result, alone)
        print(f"  {policy:>5}: GPU-hours {result.device_hours:.2f}, the gang's slowdown {s[0]:.2f}x, the LoRA jobs' "
              f"median {statistics.median(s[1:]):.2f}x (max {max(s[1:]):.2f}x), swaps {result.swaps}")  # fmt: skip


# -- plots ------------------------------------------------------------------------------------


def plot(shared: Shared | None, sim: SimResult | None, frontier: dict[str, list[Point]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    cmap = plt.get_cmap("tab20")
    panels = [p for p in (shared, sim) if p is not None]
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.5 * len(panels)), squeeze=False)
        k = 0
        if shared is not None:
            ax = axes[k][0]
            k += 1
            for lane, t in enumerate(shared.traces):
                ax.broken_barh([(a, b - a) for _, a, b in t.calls], (lane - 0.4, 0.8), color=cmap(lane % 20))
            ax.set_yticks(range(len(shared.traces)), [t.name for t in shared.traces])
            ax.set_xlabel("seconds")
            ax.set_title("(a) real, contended: all jobs on one worker under plex — calls in flight (gaps: tools)")
        if sim is not None:
            ax = axes[k][0]
            devices = sorted({s.device for s in sim.timeline}, key=lambda d: int(d[1:]))
            lanes = {d: i for i, d in enumerate(devices)}
            color = {j: cmap(i % 20) for i, j in enumerate(sorted({s.job for s in sim.timeline}))}
            for s in sim.timeline:
                ax.broken_barh([(s.start_s / 60, (s.end_s - s.start_s) / 60)], (lanes[s.device] - 0.4, 0.8),
                               color=color[s.job])  # fmt: skip
            ax.set_yticks(range(len(devices)), devices, fontsize=6)
            ax.set_xlabel("minutes")
            ax.set_title("(b) simulated: plex at its best pool size — which job's call runs on each device")
        fig.tight_layout()
        paths.append(out / "timeline.png")
        fig.savefig(paths[-1], dpi=110)
        if sim is not None:  # the same calls for a trace viewer (ui.perfetto.dev), as `plexrl trace` writes a real run
            paths.append(out / "sim-trace.json")
            paths[-1].write_text(json.dumps(chrome_trace(sim.timeline, "simulated plex")))
    if frontier:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, points in frontier.items():
            ax.plot([p.median_slowdown for p in points], [p.hours for p in points], "o-", label=policy, ms=4)
            for p in points[::3]:
                ax.annotate(str(p.devices), (p.median_slowdown, p.hours), fontsize=7)
        ax.axvline(MAX_SLOWDOWN, color="grey", ls="--", lw=1)
        ax.set_xlabel("median slowdown vs colocated-sync (numbers: devices in the pool)")
        ax.set_ylabel("GPU-hours")
        ax.set_title("simulated: 32 LoRA GRPO jobs, seed 0")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "frontier.png")
        fig.savefig(paths[-1], dpi=110)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4, help="(a) concurrent jobs")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every mode (b: seeds)")
    parser.add_argument("--regimes", nargs="+", default=[r.name for r in REGIMES], help="(a) which regimes")
    parser.add_argument("--steps", type=int, default=None, help="(a) GRPO steps per job (default: the regime's)")
    parser.add_argument("--sampler", choices=["vllm", "hf"], default="vllm", help="(a)")
    parser.add_argument("--sim-jobs", type=int, default=32, help="(b)")
    parser.add_argument("--sim-steps", type=int, default=20, help="(b) GRPO steps per job")
    parser.add_argument("--sim-min-devices", type=int, default=6, help="(b) smallest pool of the sweep")
    parser.add_argument("--part", choices=["both", "real", "sim"], default="both")
    parser.add_argument("--out", default="bench-out/multiplex")
    args = parser.parse_args()

    finals: dict[str, str] = {}
    contended: Shared | None = None
    if args.part in ("both", "real"):
        for regime in (r for r in REGIMES if r.name in args.regimes):
            regime = dataclasses.replace(regime, steps=args.steps or regime.steps)
            alone, shared = asyncio.run(real_regime(regime, args))
            outcomes = real_table(regime, alone, shared)
            if regime.name == "contended":
                contended = shared["plex"][0]
                calibration(regime, alone[0], contended, outcomes["plex"][0], args.sampler)
                plex = outcomes["plex"]
                finals["gpu_hour_reduction_real"] = (
                    f"{statistics.mean(o.reduction for o in plex):.3f} (median slowdown "
                    f"{statistics.mean(o.median_slowdown for o in plex):.2f}x; target >= 0.40 at <= {MAX_SLOWDOWN}x)"
                )
                ratio = [p.median_slowdown / f.median_slowdown for p, f in zip(plex, outcomes["fifo"], strict=True)]
                finals["plex_vs_fifo_slowdown"] = f"{spread(ratio)} (target <= 0.9)"
    sim = frontier = None
    if args.part in ("both", "sim"):
        vs_dedicated, vs_colocated, frontier, sim = sim_part(args)
        finals["gpu_hour_reduction_sim"] = f"{vs_dedicated:.3f} (target >= 0.40)"
        finals["gpu_hour_reduction_sim_vs_colocated"] = f"{vs_colocated:.3f} (target >= 0.30)"
    for path in plot(contended, sim, frontier or {}, Path(args.out)):
        print(f"plot: {path}")
    for key, value in finals.items():
        print(f"{key}={value}")


if __name__ == "__main__":
    main()
