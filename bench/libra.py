"""Libra: agent turns routed by what their tools said, and home workers lent to rollout while idle,
against arrival-order routing on a static rollout/training split.

    python bench/libra.py [--part both|real|sim] [--repeats 3] [--jobs 16] [--steps 4] [--out bench-out/libra]

(b) Simulated (``--part sim``): ``--jobs`` agentic LoRA GRPO jobs on Qwen3-``--model`` (8B) share 48 H200s
(``plexrl.sim``'s roofline costs, ``plexrl.sim.costs.pooled_agent_job``). Each job is pooled: a
step runs ``--rollouts`` trajectories at once, each ``--turns`` turns of Lognormal(``--tokens``,
``--tokens-sigma``) tokens with a tool call after each (Lognormal(``--tool-median``,
``--tool-sigma``) s, the real part's search latency; a tool call fails with probability
``--tool-error-p`` and the agent retries it: one more turn), then trains on all of them
(strictly on-policy: the next rollout waits for the weights). Jobs arrive 5 s apart. Every mode
runs on the same 40 rollout and 8 training GPUs and the same draws (every trajectory's lengths,
tool latencies and errors are drawn from (seed, job, step, trajectory), whatever the schedule,
so all modes do exactly the same work):

- static-tpK, for each K of ``--static-tp`` (1, 2, 4, 8): the 40 rollout GPUs as 40/K workers of
  K GPUs each (tensor parallel: a decode step takes 1/K of one GPU's time plus two all-reduces a
  layer of ``--all-reduce-us`` each; batches of up to ``--wide`` sequences) and 8 training workers
  holding the jobs' homes; every turn goes to a rollout worker in arrival order (one level, one
  bucket; a trajectory's next turn stays on its last worker while that has room). static-tp1 is
  the issue's baseline; the strongest of them, seed by seed, is the one the gain is taken over;
- libra: the same 40 rollout GPUs split into buckets: ``--wide-tp``-GPU workers of ``--wide``
  sequences a batch for levels 0-1, and ``--tp-groups`` workers of ``--tp`` GPUs and ``--narrow``
  sequences for levels 2-3 (short decode steps for the stragglers), the multi-level feedback
  queue of ``coordinator/buckets.py`` placing each turn by its trajectory's tokens and tool errors
  against its job's other trajectories at the same turn and its token budget; and
  ``coordinator/rebalance.py`` lending the 8 home workers to rollout while their jobs roll out (a
  move costs ``--move-s``, charged in full).

A further mode, buckets (libra without lending workers), attributes the gain.

Reported per mode: trained samples per second (trajectories trained on, over the time the last
job ended) and the time every job takes to finish its steps (its arrival to its last optimizer
step). All modes train on identical samples in identical order per job, so a job's reward after
each step is the same in all: the time to any target reward is the time to the step that
reaches it, and ``convergence_speedup`` is the ratio of the mean time to the last step. Two
limits beside the throughput gain, the strongest static's span over: libra's busy device-seconds
spread over all 48 devices without a gap (what libra's work would take on a perfectly packed
cluster); and the longest job's dependency chain (``plexrl.sim.workload.critical_path_s``: its
arrival, then step after step its slowest trajectory's turns alone on a straggler group and its
tool waits, then its training alone on one device), which no routing of turns can beat.

(a) Real (``--part real``, vLLM): two workers of one core each (one worker stands for one device),
``--real-jobs`` LoRA GRPO jobs of the tiny model alternating between the long-tailed ``sum`` task
(one turn, ten to hundreds of tokens) and the search agent (up to 4 turns; each ``<search>`` goes to
BM25 behind Lognormal(``--tool-median``, ``--tool-sigma``) s of latency): ``--real-steps`` steps
of ``--prompts`` x ``--group`` trajectories each, strictly on-policy (rollout, optimize,
sync_weights). Three modes, each on a fresh cluster, ``--repeats`` repetitions after a warm-up:

- static (the issue's baseline): worker 0 ``--role train`` holds every job's home, worker 1
  ``--role rollout`` takes every turn (pooled jobs, arrival order: one bucket);
- libra: the same, with ``--elastic``, both ways: worker 0 lends itself to rollout while no job
  of its has training to do, and is taken back by the next ``forward_backward``; worker 1, idle
  while no turn waits, joins a job's training at an optimizer-step boundary as a data-parallel
  member, and leaves it at the next boundary past that training (buckets need more rollout
  workers than two cores give: here only the elastic roles act);
- colocated (a baseline the issue does not name): both workers ``both``, a job's home on each
  (fifo spreads them), each job rolling out and training on its own worker.

``throughput_gain_real`` is libra's over the stronger of static and colocated, repetition by
repetition (the gain over each is printed too).

Every sample is seeded by (repetition, job, step, trajectory, turn), so the modes do the same work;
the table says whether every job sampled the same tokens in all modes (a digest). Reported per mode:
trained samples per second (trajectories trained on over the span), the mean time to a job's last
step, and the cores busy (every process's core-seconds over the span, and of them the coordinator's
and this script's, which share the two cores with the workers). Two limits beside the gains:
static's span over libra's if libra's rollout used both cores for all of static's rollout time
(static's span minus half its rollout worker's busy time); and the stronger baseline's span over
libra's core-seconds packed on both cores without a gap. It also prints its workload in (b)'s terms
(each task's turn lengths as a lognormal, the spread of a per-trajectory hardness, turns a
trajectory: ``plexrl.sim.workload``'s ``Lognormal.fit`` and ``hardness_sigma``) beside what (b)
assumes.

Ends with ``throughput_gain_real=``, ``throughput_gain_sim=`` (means over repetitions, worst
beside them) and ``convergence_speedup=`` (the real part's when it ran, else the simulated one's).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import marlaas  # bench/: its seeded agent rollouts and search API
import numpy as np

import plexrl
from plexrl.coordinator.buckets import Mlfq
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.scheduler import Scheduler
from plexrl.models import TINY_MODEL
from plexrl.rollout import completion
from plexrl.sim import JobModel, Lognormal, SimResult, Simulation
from plexrl.sim.costs import ALL_REDUCE_S, H200, QWEN3, pooled_agent_job, tp_comm_s
from plexrl.sim.driver import WorkerSpec
from plexrl.sim.workload import critical_path_s, hardness_sigma, job_rngs, program
from plexrl.tasks import get_task

ROLLOUT, TRAIN = 40, 8
CORES = 2  # (a)'s machine: one core a worker, shared with the coordinator and this script


# -- (a) real: two workers of one core each, the vLLM sampler ----------------------------------------

REAL_MODES: dict[str, dict[str, Any]] = {
    "static": {"roles": ["train", "rollout"], "elastic": False, "placement": "pooled"},
    "libra": {"roles": ["train", "rollout"], "elastic": True, "placement": "pooled"},
    "colocated": {"roles": ["both", "both"], "elastic": False, "placement": "colocated"},
}


@dataclass
class RealJob:
    """One job's run as its client saw it."""

    name: str
    start: float = 0.0
    steps_done_s: list[float] = field(default_factory=list)  # since its start
    trained: int = 0  # trajectories trained on
    rewards: list[float] = field(default_factory=list)  # mean training reward per step
    run: marlaas.Run | None = None  # its sampled tokens (digest) and lengths
    kind: str = ""  # its task
    turn_lengths: list[list[int]] = field(default_factory=list)  # each trajectory's turns' sampled tokens


async def real_job(index: int, rep: int, args: Any, placement: str, t0: float) -> RealJob:
    kind = marlaas.KINDS[index % 2]
    task = get_task(kind)
    spec = marlaas.Spec(index, kind, 4)
    result = RealJob(spec.name, start=time.perf_counter() - t0, run=marlaas.Run(spec), kind=kind)
    assert result.run is not None
    rng = np.random.default_rng([rep, index])
    lora, adamw = plexrl.LoRA(rank=spec.rank), plexrl.AdamW(lr=args.lr)
    async with plexrl.job(spec.name, model=TINY_MODEL, lora=lora, optimizer=adamw, seed=1000 * rep + index,
                          placement=placement) as job:  # fmt: skip
        for step in range(args.real_steps):
            problems, keys = task.sample(args.prompts, rng), (rep, index, step)
            # Every sample a trajectory (a single-turn task's is one turn): one call each, so a rollout
            # spreads over the workers that take turns.
            trajs = await marlaas.trajectories(job, task, problems, args.group, keys, args, greedy=False)
            for t in trajs:
                result.run.sampled(len(t), [turn.tokens for turn in t.turns])
                result.turn_lengths.append([len(turn.tokens) for turn in t.turns])
            rewards = [
                task.score(problems[i // args.group], completion(t, marlaas.RENDERER)) for i, t in enumerate(trajs)
            ]
            batch = plexrl.trajectory_batch(trajs, rewards, np.repeat(np.arange(len(problems)), args.group))
            await job.optimize(batch, loss="grpo")
            await job.sync_weights()
            result.trained += len(batch.tokens)
            result.rewards.append(float(np.mean(rewards)))
            result.steps_done_s.append(time.perf_counter() - t0 - result.start)
    return result


@dataclass
class RealRep:
    jobs: list[RealJob]
    span_s: float
    rollout_busy_s: float  # the rollout worker's (worker 1's) busy seconds
    moves: int  # role moves
    joins: int  # times the rollout worker joined a job's training
    cpu_s: float  # core-seconds of every process: the workers, their engines, the coordinator, this script
    workers_cpu_s: float  # of them, the workers' (and their engines')

    @property
    def samples_per_s(self) -> float:
        return sum(j.trained for j in self.jobs) / self.span_s

    @property
    def to_last_step_s(self) -> float:
        return statistics.mean(j.steps_done_s[-1] for j in self.jobs)


async def real_mode(mode: str, args: Any) -> list[RealRep]:
    conf = REAL_MODES[mode]
    cluster = plexrl.local(workers=2, roles=conf["roles"], elastic=conf["elastic"], cpus_per_worker=1,
                           sampler="vllm", max_num_seqs=args.max_num_seqs, move_prior_s=args.real_move_prior)  # fmt: skip
    reps: list[RealRep] = []
    async with cluster as client:
        warm = argparse.Namespace(**{**vars(args), "real_steps": 1, "tool_median": 1e-3, "tool_sigma": 0.0})
        await asyncio.gather(*(real_job(i, 99, warm, conf["placement"], time.perf_counter()) for i in range(2)))
        for rep in range(args.repeats):
            before = {w.name: w for w in (await client.status()).workers}
            cpu_before = [marlaas.cpu_seconds(os.getpid()), sum(marlaas.cpu_seconds(w.pid) for w in before.values())]
            t0 = time.perf_counter()
            jobs = list(await asyncio.gather(*(real_job(i, rep, args, conf["placement"], t0)
                                               for i in range(args.real_jobs))))  # fmt: skip
            span = time.perf_counter() - t0
            after = {w.name: w for w in (await client.status()).workers}
            cpu = marlaas.cpu_seconds(os.getpid()) - cpu_before[0]
            workers_cpu = sum(marlaas.cpu_seconds(w.pid) for w in after.values()) - cpu_before[1]
            busy = after["local-1"].busy_s - before["local-1"].busy_s
            moves = sum(after[n].role_moves - before[n].role_moves for n in after)
            joins = after["local-1"].joins - before["local-1"].joins
            reps.append(RealRep(jobs, span, busy, moves, joins, cpu, workers_cpu))
            print(f"  {mode:9s} repetition {rep + 1}: {span:6.1f} s, {reps[-1].samples_per_s:5.2f} samples/s, "
                  f"time to last step {reps[-1].to_last_step_s:5.1f} s, {moves} role moves, {joins} joins, {cpu / span:.2f} cores "
                  f"busy ({(cpu - workers_cpu) / span:.2f} of them the coordinator's and the clients')", flush=True)  # fmt: skip
    return reps


def real_part(args: Any) -> tuple[list[float], list[float]]:
    """Throughput gains and convergence speedups of libra over the stronger baseline, one per repetition."""
    rows = {mode: asyncio.run(real_mode(mode, args)) for mode in REAL_MODES}
    for mode, reps in rows.items():
        print(f"  {mode:9s}: {spread([r.samples_per_s for r in reps])} samples/s, time to last step "
              f"{spread([r.to_last_step_s for r in reps], 1)} s, role moves {spread([r.moves for r in reps], 0)}, "
              f"joins {spread([r.joins for r in reps], 0)}")  # fmt: skip
    digests = {
        mode: [[j.run.digest.hexdigest() for j in r.jobs if j.run is not None] for r in reps]
        for mode, reps in rows.items()
    }
    same = [digests["static"][i] == digests[m][i] for m in REAL_MODES for i in range(args.repeats)]
    print(f"  every job sampled the same tokens in every mode: {sum(same)}/{len(same)} (mode, repetition) pairs")
    calibration(rows["static"], args)
    static, libra, colocated = rows["static"], rows["libra"], rows["colocated"]
    best = [max(a, c, key=lambda r: r.samples_per_s) for a, c in zip(static, colocated, strict=True)]
    gain = [b.samples_per_s / a.samples_per_s for a, b in zip(best, libra, strict=True)]
    speedup = [a.to_last_step_s / b.to_last_step_s for a, b in zip(best, libra, strict=True)]
    limit = [a.span_s / (a.span_s - a.rollout_busy_s / 2) for a in static]
    packed = [a.span_s / (b.cpu_s / CORES) for a, b in zip(best, libra, strict=True)]
    names = ["static" if a is st else "colocated" for a, st in zip(best, static, strict=True)]
    for mode, base in (("static", static), ("colocated", colocated)):
        over = [b.samples_per_s / a.samples_per_s for a, b in zip(base, libra, strict=True)]
        print(f"  libra over {mode}: {spread(over)}")
    print(f"  the stronger baseline, repetition by repetition: {', '.join(names)}")
    print(f"  throughput gain over it {spread(gain)} (limits: {spread(limit)} over static with static's rollout time "
          f"halved; {spread(packed)} with libra's core-seconds, the coordinator's and the clients' included, packed on "
          f"both cores)")  # fmt: skip
    (Path(args.out) / "libra_real.json").write_text(json.dumps({
        mode: [{"span_s": r.span_s, "samples_per_s": r.samples_per_s, "to_last_step_s": r.to_last_step_s,
                "moves": r.moves, "joins": r.joins, "rollout_busy_s": r.rollout_busy_s, "cpu_s": r.cpu_s, "workers_cpu_s": r.workers_cpu_s,
                "jobs": [{"name": j.name, "steps_done_s": j.steps_done_s, "rewards": j.rewards} for j in r.jobs]}
               for r in reps]
        for mode, reps in rows.items()
    }, indent=1))  # fmt: skip
    return gain, speedup


def calibration(reps: list[RealRep], args: Any) -> None:
    """The real part's workload in the simulated one's terms, to set beside what (b) assumes."""
    for kind in marlaas.KINDS:
        trajs = [t for r in reps for j in r.jobs if j.kind == kind for t in j.turn_lengths]
        turns = Lognormal.fit(n for t in trajs for n in t)
        print(f"  workload, {kind}: turns of Lognormal({turns.median:.0f}, {turns.sigma:.2f}) tokens, hardness spread "
              f"{hardness_sigma(trajs):.2f}, {statistics.mean(len(t) for t in trajs):.1f} turns a trajectory (most "
              f"{max(len(t) for t in trajs)})")  # fmt: skip
    print(f"  (b) assumes turns of Lognormal({args.tokens:g}, {args.tokens_sigma:g}) tokens, hardness spread "
          f"{args.hardness:g}, {args.turns} turns and one more for each of the {args.tool_error_p:.0%} failing tool "
          f"calls; its tools take (a)'s search latency, Lognormal({args.tool_median:g}, {args.tool_sigma:g}) s")  # fmt: skip


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def jobs(args: Any) -> list[JobModel]:
    """The simulated jobs: recoverable (their snapshots kept), so that in libra idle rollout workers
    may join their training (in every mode; only libra's rebalancer acts on it)."""
    llm = QWEN3[args.model]
    return [
        dataclasses.replace(pooled_agent_job(
            f"agent{i}",
            llm,
            H200,
            steps=args.steps,
            rollouts=args.rollouts,
            turns=args.turns,
            output_tokens=Lognormal(args.tokens, args.tokens_sigma),
            tool_latency_s=Lognormal(args.tool_median, args.tool_sigma),
            tool_error_p=args.tool_error_p,
            difficulty_sigma=args.hardness,
            lora_rank=8,
            arrival_s=5.0 * i,
        ), recoverable=True)
        for i in range(args.jobs)
    ]  # fmt: skip


def simulate(mode: str, args: Any, seed: int) -> SimResult:
    # A home lent to rollout decodes as wide a batch as a rollout worker: a real worker's slots do
    # not depend on its role (only its trainer calls, two homes' at most here, run on a train worker).
    llm = QWEN3[args.model]
    train = [WorkerSpec("train", 0, args.wide)] * TRAIN

    def rollout(tp: int, bucket: int, slots: int) -> WorkerSpec:
        return WorkerSpec("rollout", bucket, slots, tp=tp, comm_s=tp_comm_s(llm, tp, args.all_reduce_us * 1e-6))

    if mode.startswith("static-tp"):  # the 40 rollout GPUs as tensor-parallel workers of this size
        tp = int(mode.removeprefix("static-tp"))
        workers = [rollout(tp, 0, args.wide)] * (ROLLOUT // tp) + train
        scheduler = Scheduler("fifo", mlfq=Mlfq(levels=1))
    else:  # the same 40 rollout GPUs: some of them in narrow tensor-parallel workers for the stragglers
        wide = (ROLLOUT - args.tp * args.tp_groups) // args.wide_tp
        workers = [rollout(args.wide_tp, 0, args.wide)] * wide + [rollout(args.tp, 2, args.narrow)] * args.tp_groups
        workers += train
        rebalancer = Rebalancer(prior_move_s=args.move_s) if mode == "libra" else None
        scheduler = Scheduler("fifo", mlfq=Mlfq(), rebalancer=rebalancer)
    sim = Simulation("fifo", len(workers), jobs(args), seed=seed, worker_specs=workers, scheduler=scheduler,
                     move_s=args.move_s)  # fmt: skip
    return sim.run()


def chain_s(args: Any, seed: int) -> float:
    """When the last job would end if each ran its dependency chain alone (``critical_path_s``), its
    turns on a straggler group."""
    models = jobs(args)
    comm = tp_comm_s(QWEN3[args.model], args.tp, args.all_reduce_us * 1e-6)
    return max(m.arrival_s + critical_path_s(program(m, rng), args.tp, comm)
               for m, rng in zip(models, job_rngs(seed, len(models)), strict=True))  # fmt: skip


def time_to_last_step(result: SimResult, arrivals: list[float]) -> float:
    return statistics.mean(j.steps_done_s[-1] - a for j, a in zip(result.jobs, arrivals, strict=True))


def sim_part(args: Any) -> dict[str, list[dict[str, float]]]:
    arrivals = [j.arrival_s for j in jobs(args)]
    modes = [f"static-tp{tp}" for tp in args.static_tp] + ["buckets", "libra"]
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for seed in range(args.repeats):
        for mode in rows:
            started = time.perf_counter()
            r = simulate(mode, args, seed)
            failed = [j.error for j in r.jobs if j.error or j.finished_s is None]
            if failed:
                raise SystemExit(f"{mode} seed {seed}: a job did not finish: {failed[0]}")
            rows[mode].append({
                "chain_s": chain_s(args, seed),
                "samples_per_s": r.trained_samples_per_s, "end_s": r.end_s, "busy": r.busy_fraction,
                "to_last_step_s": time_to_last_step(r, arrivals), "moves": r.role_moves, "joins": r.joins,
                "busy_device_s": sum(r.busy_s.values()),
            })  # fmt: skip
            print(f"  seed {seed} {mode:10s}: {r.trained_samples_per_s:7.2f} samples/s, span {r.end_s:6.0f} s, "
                  f"busy {r.busy_fraction:.2f}, {r.role_moves} role moves, {r.joins} joins "
                  f"({time.perf_counter() - started:.1f} s)",
                  flush=True)  # fmt: skip
    return rows


def sim_report(rows: dict[str, list[dict[str, float]]], args: Any) -> tuple[list[float], list[float]]:
    """Print the simulated table; return libra's throughput gains and convergence speedups over the
    strongest static layout of each seed."""
    for mode, r in rows.items():
        print(f"  {mode:10s}: {spread([x['samples_per_s'] for x in r])} samples/s, time to last step "
              f"{spread([x['to_last_step_s'] for x in r], 0)} s, busy {spread([x['busy'] for x in r])}, "
              f"role moves {spread([x['moves'] for x in r], 0)}, joins {spread([x['joins'] for x in r], 0)}")  # fmt: skip
    statics = [mode for mode in rows if mode.startswith("static-")]
    best = [max((rows[m][i] for m in statics), key=lambda x: x["samples_per_s"]) for i in range(args.repeats)]
    names = [next(m for m in statics if rows[m][i] is b) for i, b in enumerate(best)]
    libra, buckets = rows["libra"], rows["buckets"]
    gain = [lib["samples_per_s"] / st["samples_per_s"] for st, lib in zip(best, libra, strict=True)]
    alone = [b["samples_per_s"] / st["samples_per_s"] for st, b in zip(best, buckets, strict=True)]
    speedup = [st["to_last_step_s"] / lib["to_last_step_s"] for st, lib in zip(best, libra, strict=True)]
    # The limits: libra's own device-seconds packed onto all the devices without a gap; the last job's chain.
    limit = [st["end_s"] * (ROLLOUT + TRAIN) / lib["busy_device_s"] for st, lib in zip(best, libra, strict=True)]
    chain = [st["end_s"] / st["chain_s"] for st in best]
    print(f"  the strongest static layout, seed by seed: {', '.join(names)}")
    print(f"  libra's throughput gain over it {spread(gain)} (limits: {spread(limit)} with libra's busy "
          f"device-seconds packed on all {ROLLOUT + TRAIN} devices without a gap; {spread(chain)} if the last job "
          f"took only its dependency chain, every turn alone on a {args.tp}-GPU group)")  # fmt: skip
    print(f"  of it, buckets alone (no worker lent): {spread(alone)}")
    for mode in statics:
        over = [lib["samples_per_s"] / st["samples_per_s"] for st, lib in zip(rows[mode], libra, strict=True)]
        print(f"  libra over {mode}: {spread(over)}")
    return gain, speedup


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's arguments (``argv``: the command line's by default; bench/gang.py passes its own)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["both", "real", "sim"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=float, default=300.0, help="a turn's median sampled tokens")
    parser.add_argument("--tokens-sigma", type=float, default=1.0)
    parser.add_argument(
        "--tool-median",
        type=float,
        default=1.0,
        help="a tool call's median latency, seconds: (a)'s search API and (b)'s tools",
    )
    parser.add_argument("--tool-sigma", type=float, default=0.7, help="a tool call's latency spread (log space)")
    parser.add_argument("--tool-error-p", type=float, default=0.2)
    parser.add_argument("--hardness", type=float, default=0.8, help="spread of a trajectory's hardness (log space)")
    parser.add_argument("--wide", type=int, default=64, help="sequences a wide bucket's worker decodes at once")
    parser.add_argument("--narrow", type=int, default=16, help="sequences a straggler bucket's worker decodes at once")
    parser.add_argument("--tp", type=int, default=8, help="GPUs per straggler bucket worker (tensor parallel)")
    parser.add_argument("--tp-groups", type=int, default=2, help="straggler bucket workers")
    parser.add_argument("--wide-tp", type=int, default=8, help="GPUs per wide bucket worker (tensor parallel)")
    parser.add_argument(
        "--static-tp",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8],
        help="the static baselines: their rollout workers' GPUs (tensor parallel), comma-separated",
    )
    parser.add_argument("--model", choices=sorted(QWEN3), default="8B")
    parser.add_argument(
        "--all-reduce-us",
        type=float,
        default=ALL_REDUCE_S * 1e6,
        help="one all-reduce of a tensor-parallel decode step, microseconds (two a layer)",
    )
    parser.add_argument("--move-s", type=float, default=10.0, help="what moving a worker between roles costs")
    parser.add_argument("--real-jobs", type=int, default=8, help="(a) jobs, alternating sum and the search agent")
    parser.add_argument("--real-steps", type=int, default=3, help="(a) GRPO steps per job")
    parser.add_argument("--prompts", type=int, default=16, help="(a) problems per step")
    parser.add_argument("--group", type=int, default=8, help="(a) trajectories per problem (a GRPO group)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="(a) vLLM: sequences decoded at once")
    parser.add_argument("--real-move-prior", type=float, default=0.1, help="(a) a role move's cost before measured")
    parser.add_argument("--out", default="bench-out/libra")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse()
    finals: list[str] = []
    if args.part in ("real", "both"):
        print(f"(a) real, vLLM: {args.real_jobs} jobs (sum and the search agent, search latency Lognormal("
              f"{args.tool_median:g}, {args.tool_sigma:g}) s), {args.real_steps} steps of {args.prompts} x "
              f"{args.group} trajectories, on 2 workers of one core each; {args.repeats} repetitions", flush=True)  # fmt: skip
        gain, speedup = real_part(args)
        finals.append(f"throughput_gain_real={statistics.mean(gain):.2f} (worst {min(gain):.2f}; over the stronger "
                      "of static and colocated)")  # fmt: skip
        finals.append(f"convergence_speedup={statistics.mean(speedup):.2f} [{min(speedup):.2f}-{max(speedup):.2f}] "
                      "(real: the mean time to a job's last step, the stronger baseline's over libra's)")  # fmt: skip
    if args.part == "real":
        print("\n".join(finals))
        return
    print(f"(b) simulated: {args.jobs} agentic LoRA GRPO jobs on Qwen3-{args.model}, {ROLLOUT + TRAIN} H200s; "
          f"{args.steps} steps of {args.rollouts} trajectories x {args.turns} turns of Lognormal({args.tokens:g}, "
          f"{args.tokens_sigma:g}) tokens, tools Lognormal({args.tool_median:g}, {args.tool_sigma:g}) s failing {args.tool_error_p:.0%}; "
          f"seeds 0-{args.repeats - 1}", flush=True)  # fmt: skip
    rows = sim_part(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "libra_sim.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    gain, speedup = sim_report(rows, args)
    finals.insert(min(1, len(finals)), f"throughput_gain_sim={statistics.mean(gain):.2f} (worst {min(gain):.2f}; "
                  "over the strongest static layout)")  # fmt: skip
    if not any(f.startswith("convergence_speedup=") for f in finals):
        finals.append(
            f"convergence_speedup={statistics.mean(speedup):.2f} [{min(speedup):.2f}-{max(speedup):.2f}] (simulated, "
            "from the time to the last step: equal samples per step in both modes)"
        )
    else:
        print(f"  simulated convergence speedup {spread(speedup)} (time to the last step)")
    print("\n".join(finals))


if __name__ == "__main__":
    main()
