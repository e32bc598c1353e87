"""Agentic GRPO jobs on dedicated devices against the same jobs multiplexed by plexrl's ``plex``
policy: (a) for real on this machine, (b) simulated on a 64-GPU cluster. One command:

    python bench/multiplex.py [--jobs 4] [--steps 5] [--turns 3] [--out bench-out/multiplex]

(a) Real. K LoRA GRPO jobs on the shipped tiny model (tasks add, mul, rev in turn). A step is
``turns`` rounds of a ``generate`` (4 prompts x 8 samples) followed by a tool call off the
accelerator (a wait drawn from Lognormal(median 1.0 s, sigma 0.5), the same draws in both runs;
the last one stands for the verifier), then ``forward_backward``, ``optim_step`` and
``sync_weights``. First every job runs alone on one worker (``dedicated``: a device held for its
whole wall time), then all K together on one worker under ``plex``, with a device budget that
holds two jobs' state, so state moves for real. GPU-hours: dedicated = the sum of the jobs'
walls; plex = the span of the shared run (one device held from the first open to the last close).

Calibration. The dedicated runs' measured call times (seconds per decode step, per trained
token, per optimizer step and sync) and output lengths define a ``JobModel`` per job; the
simulator then predicts part (a) (same policies, one slot per device as the hf worker
registers) and the table shows prediction next to measurement.

(b) Simulated. 32 LoRA GRPO jobs on Qwen3 1.7B/4B/8B (``plexrl.sim.costs``, roofline cost
models of an H200; 3 turns with tools of median 8 s, 20 steps, one job arriving every 20 s) on
64 GPUs: ``dedicated`` = a rollout GPU and a trainer GPU per job (disaggregated; synchronous
on-policy, so each idles while the other works: the same program as colocated, on twice the
devices); ``colocated-sync`` = one GPU per job, rollout then train on it (verl's hybrid engine);
``plex`` = the jobs share the pool (3 calls at once per GPU; same-base generates batch).

Prints one table per part, writes ``timeline.png`` (which job occupies each device over time)
and ends with ``gpu_hour_reduction_real=`` and ``gpu_hour_reduction_sim=`` (both vs dedicated).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import hashlib
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
from plexrl.sim.costs import H200, QWEN3, grpo_job
from plexrl.tasks import get_task

TASKS = ("add", "mul", "rev")
TOKENIZER = CharTokenizer()
SIM_SIZES = ("1.7B", "4B", "8B")


@dataclass
class Trace:
    """One job's run as its client saw it (seconds since the run began)."""

    name: str
    start: float = 0.0
    end: float = 0.0
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, submitted, answered)
    lengths: list[int] = field(default_factory=list)  # completion lengths
    gen_steps: list[int] = field(default_factory=list)  # per generate: its longest completion
    tokens: list[int] = field(default_factory=list)  # per forward_backward: tokens trained
    rewards: list[float] = field(default_factory=list)  # per step: mean reward of the last turn
    samples: Any = field(default_factory=hashlib.sha256)  # digest of every token it sampled, in order
    stats: JobInfo | None = None

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def seconds(self, kind: str) -> list[float]:
        return [b - a for k, a, b in self.calls if k == kind]


async def agent(index: int, args: argparse.Namespace, t0: float) -> Trace:
    """One agentic GRPO job; its draws (problems, tool waits) depend only on ``index``."""
    task = get_task(TASKS[index % len(TASKS)])
    trace = Trace(f"{task.name}{index}")
    rng = np.random.default_rng(1000 + index)
    tool = Lognormal(args.tool_median, args.tool_sigma)
    sampling = plexrl.SamplingParams(n=args.group, max_tokens=args.max_tokens, temperature=1.0)
    clock = time.perf_counter

    async def timed(kind: str, call):  # type: ignore[no-untyped-def]
        submitted = clock() - t0
        result = await call
        trace.calls.append((kind, submitted, clock() - t0))
        return result

    trace.start = clock() - t0
    lora, adamw = plexrl.LoRA(rank=8), plexrl.AdamW(lr=3e-2)
    async with plexrl.job(trace.name, model=TINY_MODEL, lora=lora, optimizer=adamw, seed=index) as job:
        for _ in range(args.steps):
            problems = task.sample(args.prompts, rng)
            prompts = [TOKENIZER.encode(p.prompt) for p in problems]
            for _ in range(args.turns):
                out = await timed("generate", job.generate(prompts, sampling))
                lengths = [len(s.tokens) for s in out.samples]
                for s in out.samples:
                    trace.samples.update(np.asarray(s.tokens, np.int32).tobytes() + b"|")
                trace.lengths += lengths
                trace.gen_steps.append(max(lengths))
                await asyncio.sleep(float(tool.draw(rng)))  # the tool: off the accelerator
            rewards = [task.score(problems[s.prompt_index], TOKENIZER.decode(s.tokens)) for s in out.samples]
            trace.rewards.append(float(np.mean(rewards)))
            fb = await timed("forward_backward", job.forward_backward(plexrl.grpo_batch(prompts, out, rewards)))
            trace.tokens.append(fb.num_tokens)
            await timed("optim_step", job.optim_step())
            await timed("sync_weights", job.sync_weights())
        trace.stats = await job.stats()
    trace.end = clock() - t0
    return trace


async def warm_up(args: argparse.Namespace) -> None:
    """Load the model and warm torch on the worker, so no measured job pays for it."""
    warm = argparse.Namespace(**{**vars(args), "steps": 1, "turns": 1, "tool_median": 1e-3})
    await agent(99, warm, time.perf_counter())


async def real_part(args: argparse.Namespace) -> tuple[list[Trace], list[Trace], float]:
    print(f"(a) real: {args.jobs} jobs x {args.steps} steps x {args.turns} turns, tools ~ "
          f"Lognormal(median {args.tool_median} s, sigma {args.tool_sigma})", flush=True)  # fmt: skip
    alone: list[Trace] = []
    async with plexrl.local(workers=1, policy="dedicated"):
        await warm_up(args)
        for i in range(args.jobs):
            alone.append(await agent(i, args, time.perf_counter()))
            print(f"  dedicated: {alone[-1].name} alone in {alone[-1].wall_s:.1f} s", flush=True)
    budget = budget_for(alone)
    async with plexrl.local(workers=1, policy="plex", memory_budget_bytes=budget):
        await warm_up(args)
        t0 = time.perf_counter()
        shared = list(await asyncio.gather(*(agent(i, args, t0) for i in range(args.jobs))))
        span = max(t.end for t in shared) - min(t.start for t in shared)
    print(f"  plex: {args.jobs} jobs on one worker (budget {budget} B) in {span:.1f} s", flush=True)
    return alone, shared, span


def calibrated(trace: Trace, args: argparse.Namespace, state_bytes: int) -> JobModel:
    """The simulator's model of a job, from its run alone (see the module docstring)."""
    logs = np.log(np.maximum(1, trace.lengths))
    return JobModel(
        trace.name,
        steps=args.steps,
        rollouts=args.prompts * args.group,
        turns=args.turns,
        output_tokens=Lognormal(float(np.exp(np.median(logs))), float(np.std(logs))),
        decode_step_s=sum(trace.seconds("generate")) / sum(trace.gen_steps),
        tool_latency_s=Lognormal(args.tool_median, args.tool_sigma),
        train_s_per_token=sum(trace.seconds("forward_backward")) / sum(trace.tokens),
        optim_step_s=statistics.mean(trace.seconds("optim_step")),
        sync_s=statistics.mean(trace.seconds("sync_weights")),
        state_bytes=state_bytes,
    )


def budget_for(alone: list[Trace]) -> int:
    """A device budget that holds two jobs' state (of ``args.jobs``): the rest wait in host memory."""
    assert alone[0].stats is not None
    return 2 * alone[0].stats.state_bytes + alone[0].stats.state_bytes // 2


def real_table(alone: list[Trace], shared: list[Trace], span: float, args: argparse.Namespace) -> float:
    print(f"\n(a) real, this machine: {args.jobs} jobs, dedicated (each alone) vs plex (all on one worker)")
    print(f"{'job':>6} {'wall alone':>10} {'wall plex':>10} {'slowdown':>8} {'accel-s':>8} {'swaps':>6} "
          f"{'swap ms':>8} {'mean reward alone':>17} {'under plex':>10}")  # fmt: skip
    slowdowns = []
    for a, s in zip(alone, shared, strict=True):
        assert s.stats is not None
        slowdowns.append(s.wall_s / a.wall_s)
        print(f"{a.name:>6} {a.wall_s:>10.2f} {s.wall_s:>10.2f} {slowdowns[-1]:>8.2f} {s.stats.accelerator_s:>8.2f} "
              f"{s.stats.swaps:>6} {1e3 * s.stats.swap_s:>8.2f} {np.mean(a.rewards):>17.3f} {np.mean(s.rewards):>10.3f}")  # fmt: skip
    dedicated = sum(t.wall_s for t in alone)
    user = sum(t.stats.accelerator_s for t in shared if t.stats) / dedicated
    reduction = 1 - span / dedicated
    same = all(a.samples.digest() == s.samples.digest() for a, s in zip(alone, shared, strict=True))
    print(f"device-seconds: dedicated {dedicated:.1f}, plex {span:.1f} (one device)  ->  reduction {reduction:.3f}")
    print(f"median slowdown {statistics.median(slowdowns):.2f}x (max {max(slowdowns):.2f}x); "
          f"user cost (accelerator-s / dedicated device-s) {user:.3f}; "
          f"every sample identical alone and under plex (so every update): {same}")  # fmt: skip

    moved = sum(t.stats.swap_bytes for t in shared if t.stats)
    moving = sum(t.stats.swap_s for t in shared if t.stats)
    models = [calibrated(t, args, t.stats.state_bytes if t.stats else 0) for t in alone]
    sim_alone = Simulation("dedicated", len(models), models, seed=1).run()
    sim_plex = Simulation(
        "plex", 1, models, seed=1, memory_bytes=budget_for(alone), swap_bytes_per_s=moved / moving if moving else 1e9
    ).run()
    sim_slow = [p.wall_s / d.wall_s for p, d in zip(sim_plex.jobs, sim_alone.jobs, strict=True)]
    sim_reduction = 1 - sim_plex.device_hours / sim_alone.device_hours
    print("calibration: the simulator, fed the models fitted to the dedicated runs, predicts")
    print(f"{'':>22} {'measured':>9} {'simulated':>9}")
    print(f"{'wall alone, mean (s)':>22} {statistics.mean(t.wall_s for t in alone):>9.2f} "
          f"{statistics.mean(j.wall_s for j in sim_alone.jobs):>9.2f}")  # fmt: skip
    print(f"{'median slowdown':>22} {statistics.median(slowdowns):>9.2f} {statistics.median(sim_slow):>9.2f}")
    print(f"{'GPU-hour reduction':>22} {reduction:>9.3f} {sim_reduction:>9.3f}")
    return reduction


def sim_jobs(args: argparse.Namespace) -> list[JobModel]:
    return [
        grpo_job(SIM_SIZES[i % 3], QWEN3[SIM_SIZES[i % 3]], steps=args.sim_steps, arrival_s=20.0 * i)
        for i in range(args.sim_jobs)
    ]


def sim_part(args: argparse.Namespace) -> tuple[dict[str, SimResult], float, float]:
    jobs = sim_jobs(args)
    memory = H200.memory_bytes - sum(QWEN3[s].weight_bytes for s in SIM_SIZES)  # every base may be loaded
    t = time.perf_counter()
    colocated = Simulation("dedicated", args.gpus, jobs, seed=0).run()
    plex = Simulation(
        "plex", args.gpus, jobs, seed=0, slots=3, memory_bytes=memory, swap_bytes_per_s=H200.host_bytes_per_s,
        record_timeline=True,
    ).run()  # fmt: skip
    print(f"\n(b) simulated ({time.perf_counter() - t:.1f} s): {args.sim_jobs} LoRA GRPO jobs (Qwen3 "
          f"{'/'.join(SIM_SIZES)}) on {args.gpus} x {H200.name}")  # fmt: skip
    rows = {
        "dedicated": (2 * colocated.device_hours, colocated, 2 * len(colocated.held_s)),
        "colocated-sync": (colocated.device_hours, colocated, len(colocated.held_s)),
        "plex": (plex.device_hours, plex, len(plex.held_s)),
    }
    base_h = rows["dedicated"][0]
    print(f"{'policy':>15} {'GPUs used':>9} {'GPU-hours':>9} {'busy':>5} {'median slowdown':>15} {'max':>5} "
          f"{'reduction':>9}")  # fmt: skip
    for name, (hours, result, used) in rows.items():
        slow = [r.wall_s / c.wall_s for r, c in zip(result.jobs, colocated.jobs, strict=True)]
        busy = sum(result.busy_s.values()) / (hours * 3600)
        print(f"{name:>15} {used:>9} {hours:>9.2f} {busy:>5.2f} {statistics.median(slow):>15.2f} {max(slow):>5.2f} "
              f"{1 - hours / base_h:>9.3f}")  # fmt: skip
    vs_dedicated = 1 - plex.device_hours / base_h
    vs_colocated = 1 - plex.device_hours / colocated.device_hours
    billed = sum(j.accelerator_s for j in plex.jobs) / 3600
    print(f"plex vs colocated-sync: {vs_colocated:.3f} fewer GPU-hours; swaps {plex.swaps}; billed per "
          f"accelerator-second instead of per held GPU, plex jobs would pay {billed:.2f} GPU-hours "
          f"({billed / base_h:.3f} of dedicated)")  # fmt: skip
    return {"colocated": colocated, "plex": plex}, vs_dedicated, vs_colocated


def plot(shared: list[Trace], sim: SimResult | None, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    panels = (1 if shared else 0) + (1 if sim else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.5 * panels), squeeze=False)
    cmap = plt.get_cmap("tab20")
    k = 0
    if shared:
        ax = axes[k][0]
        k += 1
        for lane, t in enumerate(shared):
            bars = [(a, b - a) for _, a, b in t.calls]
            ax.broken_barh(bars, (lane - 0.4, 0.8), color=cmap(lane % 20))
        ax.set_yticks(range(len(shared)), [t.name for t in shared])
        ax.set_xlabel("seconds")
        ax.set_title("(a) real: all jobs on one worker under plex — each job's calls in flight (gaps: tools)")
    if sim:
        ax = axes[k][0]
        devices = sorted({d for d, *_ in sim.timeline}, key=lambda d: int(d[1:]))
        lanes = {d: i for i, d in enumerate(devices)}
        jobs = sorted({j for _, j, *_ in sim.timeline})
        color = {j: cmap(i % 20) for i, j in enumerate(jobs)}
        for d, j, a, b in sim.timeline:
            ax.broken_barh([(a / 60, (b - a) / 60)], (lanes[d] - 0.4, 0.8), color=color[j])
        ax.set_yticks(range(len(devices)), devices, fontsize=6)
        ax.set_xlabel("minutes")
        ax.set_title(
            "(b) simulated: plex on the GPUs it used — which job's call runs on each device (one color per job)"
        )
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4, help="(a) concurrent jobs")
    parser.add_argument("--steps", type=int, default=5, help="(a) GRPO steps per job")
    parser.add_argument("--turns", type=int, default=3, help="(a) generate + tool rounds per step")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tool-median", type=float, default=1.0, help="(a) tool latency median, s")
    parser.add_argument("--tool-sigma", type=float, default=0.5, help="(a) tool latency log-space spread")
    parser.add_argument("--gpus", type=int, default=64, help="(b)")
    parser.add_argument("--sim-jobs", type=int, default=32, help="(b)")
    parser.add_argument("--sim-steps", type=int, default=20, help="(b) GRPO steps per job")
    parser.add_argument("--part", choices=["both", "real", "sim"], default="both")
    parser.add_argument("--out", default="bench-out/multiplex")
    args = parser.parse_args()

    shared: list[Trace] = []
    real = sim = None
    sims: dict[str, SimResult] = {}
    if args.part in ("both", "real"):
        alone, shared, span = asyncio.run(real_part(args))
        real = real_table(alone, shared, span, args)
    if args.part in ("both", "sim"):
        sims, sim, vs_colocated = sim_part(args)
        print(f"gpu_hour_reduction_sim_vs_colocated={vs_colocated:.3f}")
    print(f"timeline: {plot(shared, sims.get('plex'), Path(args.out))}")
    if real is not None:
        print(f"gpu_hour_reduction_real={real:.3f}")
    if sim is not None:
        print(f"gpu_hour_reduction_sim={sim:.3f}")


if __name__ == "__main__":
    main()
