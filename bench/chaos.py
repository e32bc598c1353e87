"""Chaos: concurrent GRPO jobs on a few workers while workers and the coordinator are SIGKILLed.

    python bench/chaos.py [--jobs 8] [--workers 3] [--steps 6] [--kill-every 6] [--coordinator-kills 1]
                          [--repeats 3] [--sampler vllm|hf] [--soak HOURS]

Each job is a LoRA GRPO loop on the shipped model (the long-tailed ``sum`` task and ``add`` in
turn; ``--steps`` steps of ``--prompts`` x ``--group`` samples: generate, reward, forward_backward,
optim_step, sync_weights), then saves its adapter. First a fault-free run of every job (the
reference), then ``--repeats`` runs of the same jobs (same seeds) while a chaos task SIGKILLs a
random worker every Exp(``--kill-every``) seconds and starts a replacement ``--restart-after``
seconds later, and SIGKILLs the coordinator ``--coordinator-kills`` times (at random moments
between 20% and 70% of the reference's wall time), starting it again on its journal
``--restart-after`` seconds later. plexrl's promise (docs/architecture.md, "Guarantees"): the
coordinator restores each job of a lost worker on another one from its last optimizer step's
snapshot and the calls since, and runs its interrupted calls again; a restarted coordinator
resumes every job from its journal, and each client reconnects and settles its unanswered calls
by its job's commit point; so the loop sees only latency.

Measured per faulty run: optimizer steps lost (a job that ended with fewer than ``--steps``, from
its saved checkpoint's manifest) and applied twice (more), jobs finished, recovery time (from a
kill to the next completed call of each job the killed worker held; p50 and max), and whether each
job's final adapter equals the reference's bit for bit (every sampled token and every update
agreed). A second fault-free run (the control) bounds that equality: what two runs without faults
share is all a faulty run can be expected to. Ends with ``steps_lost=``, ``steps_applied_twice=``, ``jobs_finished=k/n`` and
``final_adapters_equal=k/n`` (the worst repetition). ``--soak HOURS`` instead loops jobs for that
long under worker chaos and prints the coordinator's and workers' resident memory every minute.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

import plexrl
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.tasks import get_task
from plexrl.text import Renderer

RENDERER = Renderer(CharTokenizer())
TASKS = ("sum", "add")


@dataclass
class JobRun:
    """One job's loop as its script saw it."""

    name: str
    steps: list[int] = field(default_factory=list)  # the step number each optim_step reported
    done_at: list[float] = field(default_factory=list)  # when each of its calls completed (monotonic)
    finished: bool = False
    error: str = ""
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # its saved adapter
    saved_step: int = -1  # the step its checkpoint's manifest records
    recoveries: int = 0


@dataclass
class Kill:
    at: float  # monotonic
    worker_id: str  # or "coordinator"
    jobs: list[str]  # names of the jobs whose home it was (every job, for the coordinator)


async def job_loop(name: str, index: int, args: Any, run_tag: str) -> JobRun:
    """One GRPO job, start to finish; every call's completion time recorded."""
    run = JobRun(name)
    task = get_task(TASKS[index % len(TASKS)])
    rng = np.random.default_rng(index)
    params = plexrl.SamplingParams(n=args.group, max_tokens=task.max_tokens, temperature=1.0)

    async def timed(call: Any) -> Any:
        result = await call
        run.done_at.append(time.monotonic())
        return result

    try:
        async with plexrl.job(name, TINY_MODEL, lora=plexrl.LoRA(rank=4), optimizer=plexrl.AdamW(lr=2e-3),
                              seed=index) as job:  # fmt: skip
            for _ in range(args.steps):
                problems = task.sample(args.prompts, rng)
                prompts = [RENDERER.prompt(p.prompt) for p in problems]
                out = await timed(job.generate(prompts, params))
                rewards = [task.score(problems[s.prompt_index], RENDERER.text(s.tokens)) for s in out.samples]
                await timed(job.forward_backward(plexrl.grpo_batch(prompts, out, rewards), loss="grpo"))
                run.steps.append((await timed(job.optim_step())).step)
                await timed(job.sync_weights())
            saved = await timed(job.save(f"chaos-{run_tag}/{name}"))
            run.recoveries = (await job.stats()).recoveries
        path = Path(saved.path)
        run.weights = load_file(str(path / "weights.safetensors"))
        run.saved_step = json.loads((path / "manifest.json").read_text())["step"]
        run.finished = True
    except plexrl.errors.PlexError as e:
        run.error = f"{type(e).__name__}: {e}"
    return run


async def chaos(cluster: plexrl.LocalCluster, client: plexrl.Client, args: Any, seed: int, kills: list[Kill]) -> None:
    """SIGKILL a random worker every Exp(kill_every) s; start a replacement restart_after s later."""
    rng = np.random.default_rng(seed)
    while True:
        await asyncio.sleep(float(rng.exponential(args.kill_every)))
        status = await client.status()
        live = [p for p in cluster.worker_processes if p.returncode is None]
        if not status.workers or not live:
            continue
        victim = status.workers[int(rng.integers(len(status.workers)))]
        process = next((p for p in live if p.pid == victim.pid), None)
        if process is None:
            continue
        names = [j.name for j in status.jobs if j.worker_id == victim.worker_id]
        process.kill()
        kills.append(Kill(time.monotonic(), victim.worker_id, names))
        print(f"    killed worker {victim.worker_id} (pid {victim.pid}) holding {', '.join(names) or 'no job'}",
              flush=True)  # fmt: skip
        await asyncio.sleep(args.restart_after)
        cluster.worker_processes.remove(process)
        await process.wait()
        cluster.reap(process)  # its engine processes, as its supervisor would
        await cluster.start_worker(int(victim.name.rsplit("-", 1)[1]))  # local-i: on worker i's cores


async def kill_coordinator(cluster: plexrl.LocalCluster, at: tuple[float, ...], args: Any, kills: list[Kill]) -> None:
    """SIGKILL the coordinator ``at`` these seconds from now; start it again on its address and
    journal ``restart_after`` s later (its workers and clients reconnect by themselves)."""
    start = time.monotonic()
    for when in sorted(at):
        await asyncio.sleep(max(0.0, start + when - time.monotonic()))
        assert cluster.coordinator is not None
        cluster.coordinator.kill()
        kills.append(Kill(time.monotonic(), "coordinator", [f"job{i}" for i in range(args.jobs)]))
        print(f"    killed the coordinator (pid {cluster.coordinator.pid})", flush=True)
        await cluster.coordinator.wait()
        await asyncio.sleep(args.restart_after)
        await cluster.start_coordinator()


async def one_run(
    args: Any, root: Path, run_tag: str, chaos_seed: int | None, coordinator_kills_at: tuple[float, ...] = ()
) -> tuple[list[JobRun], list[Kill], float]:
    cluster = plexrl.local(
        workers=args.workers, sampler=args.sampler, policy="plex", checkpoint_root=root, start_timeout_s=600,
        heartbeat_interval_s=args.heartbeat, heartbeat_liveness=5, max_loras=8,
        journal=root / f"journal-{run_tag}.sqlite",
    )  # fmt: skip
    kills: list[Kill] = []
    async with cluster as client:
        start = time.monotonic()
        jobs = [asyncio.create_task(job_loop(f"job{i}", i, args, run_tag)) for i in range(args.jobs)]
        chaos_tasks = []
        if chaos_seed is not None:
            chaos_tasks.append(asyncio.create_task(chaos(cluster, client, args, chaos_seed, kills)))
        if coordinator_kills_at:
            chaos_tasks.append(asyncio.create_task(kill_coordinator(cluster, coordinator_kills_at, args, kills)))
        runs = list(await asyncio.gather(*jobs))
        for task in chaos_tasks:
            task.cancel()
        await asyncio.gather(*chaos_tasks, return_exceptions=True)
        wall = time.monotonic() - start
    return runs, kills, wall


@dataclass
class Outcome:
    steps_lost: int
    steps_applied_twice: int
    finished: int
    equal: int
    recovery_s: list[float]
    kills: int
    coordinator_kills: int
    recoveries: int
    wall_s: float
    gap: float  # largest relative adapter difference from the reference (0: bit-equal or unfinished)


def judge(runs: list[JobRun], reference: list[JobRun], kills: list[Kill], args: Any, wall_s: float) -> Outcome:
    lost = twice = equal = 0
    gap = 0.0  # the largest relative difference of a finished job's adapter from the reference's
    for run, ref in zip(runs, reference, strict=True):
        done = run.saved_step if run.finished else (run.steps[-1] if run.steps else 0)
        lost += max(0, args.steps - done)
        twice += max(0, done - args.steps) + (run.steps != sorted(set(run.steps)))
        same = run.finished and run.weights.keys() == ref.weights.keys()
        equal += same and all(np.array_equal(run.weights[k], ref.weights[k]) for k in ref.weights)
        if same:
            gap = max([gap, *(relative_gap(run.weights[k], ref.weights[k]) for k in ref.weights)])
    by_name = {r.name: r for r in runs}
    recovery = [
        min((t for t in by_name[name].done_at if t > kill.at), default=float("nan")) - kill.at
        for kill in kills
        for name in kill.jobs
        if name in by_name
    ]
    workers_killed = sum(k.worker_id != "coordinator" for k in kills)
    return Outcome(lost, twice, sum(r.finished for r in runs), equal, [r for r in recovery if r == r], workers_killed,
                   len(kills) - workers_killed, sum(r.recoveries for r in runs), wall_s, gap)  # fmt: skip


def relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over max |b|: how far an adapter tensor is from the reference's."""
    scale = float(np.abs(b).max()) or 1.0
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) / scale


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(args: Any, root: Path) -> None:
    """Jobs in a loop under chaos for ``--soak`` hours; memory of the coordinator and workers each minute."""
    cluster = plexrl.local(workers=args.workers, sampler=args.sampler, policy="plex", checkpoint_root=root,
                           start_timeout_s=600, heartbeat_interval_s=args.heartbeat)  # fmt: skip
    async with cluster as client:
        kills: list[Kill] = []
        chaos_task = asyncio.create_task(chaos(cluster, client, args, 0, kills))
        end, rounds = time.monotonic() + args.soak * 3600, 0

        async def jobs_forever() -> None:
            nonlocal rounds
            while True:
                await asyncio.gather(
                    *(job_loop(f"soak{rounds}-{i}", i, args, f"soak{rounds}") for i in range(args.jobs))
                )
                rounds += 1

        work = asyncio.create_task(jobs_forever())
        while time.monotonic() < end:
            await asyncio.sleep(60)
            assert cluster.coordinator is not None
            workers = [rss_mib(p.pid) for p in cluster.worker_processes if p.returncode is None]
            print(f"  {time.strftime('%H:%M:%S')} rounds {rounds} kills {len(kills)} coordinator "
                  f"{rss_mib(cluster.coordinator.pid):.0f} MiB, workers {' '.join(f'{w:.0f}' for w in workers)} MiB",
                  flush=True)  # fmt: skip
        for t in (work, chaos_task):
            t.cancel()
        await asyncio.gather(work, chaos_task, return_exceptions=True)


async def measure(args: Any, root: Path) -> None:
    print(
        f"reference: {args.jobs} jobs, {args.steps} GRPO steps each, on {args.workers} workers, no faults", flush=True
    )
    reference, _, ref_wall = await one_run(args, root, "reference", None)
    broken = [r for r in reference if not r.finished]
    if broken:
        raise SystemExit(f"the fault-free run failed: {broken[0].name}: {broken[0].error}")
    print(f"  {ref_wall:.1f} s")
    # The bound on bit-equality that faults do not cause: a second fault-free run of the same jobs.
    control, _, control_wall = await one_run(args, root, "control", None)
    control_outcome = judge(control, reference, [], args, control_wall)
    control_equal = control_outcome.equal
    print(
        f"control (fault-free again): {control_wall:.1f} s, adapters equal to the reference {control_equal}/{args.jobs}, "
        f"largest relative difference {control_outcome.gap:.2e}"
    )
    outcomes = []
    for rep in range(args.repeats):
        print(f"faulty run {rep + 1}: a worker SIGKILLed every Exp({args.kill_every} s), the coordinator "
              f"{args.coordinator_kills} time(s); each restarted {args.restart_after} s later", flush=True)  # fmt: skip
        rng = np.random.default_rng(1000 + rep)
        at = tuple(float(t) for t in rng.uniform(0.2, 0.7, args.coordinator_kills) * ref_wall)
        runs, kills, wall = await one_run(args, root, f"faulty{rep}", chaos_seed=rep, coordinator_kills_at=at)
        outcome = judge(runs, reference, kills, args, wall)
        outcomes.append(outcome)
        for r in runs:
            if not r.finished:
                print(f"    {r.name} did not finish: {r.error}")
        print(f"  {wall:.1f} s, {outcome.kills} worker kills, {outcome.coordinator_kills} coordinator kills, "
              f"{outcome.recoveries} job recoveries; steps lost "
              f"{outcome.steps_lost}, applied twice {outcome.steps_applied_twice}, finished "
              f"{outcome.finished}/{args.jobs}, adapters equal to the reference {outcome.equal}/{args.jobs} "
              f"(largest relative difference {outcome.gap:.2e})", flush=True)  # fmt: skip
    recovery = [s for o in outcomes for s in o.recovery_s]
    print(f"\n{args.jobs} jobs x {args.steps} steps on {args.workers} workers ({args.sampler} sampler), "
          f"{args.repeats} faulty runs against one fault-free reference ({ref_wall:.1f} s)")  # fmt: skip
    print(f"  worker kills per run {spread([o.kills for o in outcomes], 1)}, coordinator kills per run "
          f"{spread([o.coordinator_kills for o in outcomes], 1)}, job recoveries per run "
          f"{spread([o.recoveries for o in outcomes], 1)}, wall s {spread([o.wall_s for o in outcomes], 1)}")  # fmt: skip
    if recovery:
        p50 = float(np.percentile(recovery, 50))
        print(f"  recovery time (a kill to the next completed call of each job it held, {len(recovery)} of them): "
              f"p50 {p50:.2f} s, max {max(recovery):.2f} s; the heartbeat window alone is "
              f"{args.heartbeat * 5:.1f} s, a restart waits {args.restart_after:g} s")  # fmt: skip
    worst = max(outcomes, key=lambda o: (o.steps_lost + o.steps_applied_twice, -o.finished, -o.equal))
    print(f"adapter differences from the reference (max |a-b| / max |b|): control {control_outcome.gap:.2e}, "
          f"faulty runs at most {max(o.gap for o in outcomes):.2e}")  # fmt: skip
    print(f"control_adapters_equal={control_equal}/{args.jobs}  (two fault-free runs: the bound on the line below)")
    print(f"steps_lost={worst.steps_lost}")
    print(f"steps_applied_twice={worst.steps_applied_twice}")
    print(f"jobs_finished={min(o.finished for o in outcomes)}/{args.jobs}")
    print(f"final_adapters_equal={min(o.equal for o in outcomes)}/{args.jobs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per job")
    parser.add_argument("--prompts", type=int, default=4, help="problems per step")
    parser.add_argument("--group", type=int, default=4, help="samples per problem")
    parser.add_argument("--kill-every", type=float, default=6.0, help="mean seconds between worker kills")
    parser.add_argument("--coordinator-kills", type=int, default=1, help="coordinator SIGKILLs per faulty run")
    parser.add_argument(
        "--restart-after", type=float, default=2.0, help="seconds until a killed worker or coordinator is restarted"
    )
    parser.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat interval (a worker is dead after 5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampler", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--soak", type=float, default=0.0, help="hours of jobs under chaos, printing memory")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plexrl-chaos-"))
    asyncio.run(soak(args, root) if args.soak else measure(args, root))


if __name__ == "__main__":
    main()
