"""Libra: agent turns routed by what their tools said, and home workers lent to rollout while idle,
against arrival-order routing on a static rollout/training split.

    python bench/libra.py [--part sim] [--repeats 3] [--jobs 16] [--steps 4] [--out bench-out/libra]

(b) Simulated (``--part sim``): ``--jobs`` agentic LoRA GRPO jobs on Qwen3-1.7B share 48 H200s
(``plexrl.sim``'s roofline costs, ``plexrl.sim.costs.pooled_agent_job``). Each job is pooled: a
step runs ``--rollouts`` trajectories at once, each ``--turns`` turns of Lognormal(``--tokens``,
``--tokens-sigma``) tokens with a tool call after each (Lognormal(``--tool-median``, 1.0) s; a
tool call fails with probability ``--tool-error-p`` and the agent retries it: one more turn),
then trains on all of them (strictly on-policy: the next rollout waits for the weights). Jobs
arrive 5 s apart. Two modes on the same workers and the same draws (every trajectory's lengths,
tool latencies and errors are drawn from (seed, job, step, trajectory), whatever the schedule,
so both modes do exactly the same work):

- static: 40 rollout workers (batches of up to ``--wide`` sequences) and 8 training workers
  holding the jobs' homes; every turn goes to a rollout worker in arrival order (one level, one
  bucket; a trajectory's next turn stays on its last worker while that has room);
- libra: the same 40 rollout workers split into buckets, 32 wide (level 0-1) and 8 narrow
  (``--narrow`` sequences a batch, levels 2-3: fast decode steps for the stragglers), the
  multi-level feedback queue of ``coordinator/buckets.py`` placing each turn by its trajectory's
  attained service, turns and tool errors; and ``coordinator/rebalance.py`` lending the 8 home
  workers to rollout while their jobs roll out (a move costs ``--move-s``, charged in full).

A third mode, buckets (libra without lending workers), attributes the gain.

Reported per mode: trained samples per second (trajectories trained on, over the time the last
job ended) and the time every job takes to finish its steps (its arrival to its last optimizer
step). Both modes train on identical samples in identical order per job, so a job's reward after
each step is the same in both: the time to any target reward is the time to the step that
reaches it, and ``convergence_speedup`` is the ratio of the mean time to the last step. The limit
beside the throughput gain: static's span over libra's busy device-seconds spread over all 48
devices without a gap (what libra's work would take on a perfectly packed cluster).

(a) Real (``--part real``): not built yet: pooled jobs do not run on real workers yet (the
coordinator's server does not replicate adapters to rollout workers); the bench says so and
prints no ``throughput_gain_real``.

Ends with ``throughput_gain_sim=`` (mean over seeds, worst beside it) and
``convergence_speedup=``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from plexrl.coordinator.buckets import Mlfq
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.scheduler import Scheduler
from plexrl.sim import JobModel, Lognormal, SimResult, Simulation
from plexrl.sim.costs import H200, QWEN3, pooled_agent_job, tp_comm_s
from plexrl.sim.driver import WorkerSpec

ROLLOUT, TRAIN = 40, 8


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def jobs(args: Any) -> list[JobModel]:
    llm = QWEN3[args.model]
    return [
        pooled_agent_job(
            f"agent{i}",
            llm,
            H200,
            steps=args.steps,
            rollouts=args.rollouts,
            turns=args.turns,
            output_tokens=Lognormal(args.tokens, args.tokens_sigma),
            tool_latency_s=Lognormal(args.tool_median, 1.0),
            tool_error_p=args.tool_error_p,
            difficulty_sigma=args.hardness,
            lora_rank=8,
            arrival_s=5.0 * i,
        )
        for i in range(args.jobs)
    ]


def simulate(mode: str, args: Any, seed: int) -> SimResult:
    train = [WorkerSpec("train", 0, 4)] * TRAIN
    if mode == "static":
        workers = [WorkerSpec("rollout", 0, args.wide)] * ROLLOUT + train
        scheduler = Scheduler("fifo", mlfq=Mlfq(levels=1))
    else:  # the same 40 rollout GPUs: some of them in tensor-parallel groups for the stragglers
        llm = QWEN3[args.model]
        fast = WorkerSpec("rollout", 2, args.narrow, tp=args.tp, comm_s=tp_comm_s(llm, args.tp))
        workers = [WorkerSpec("rollout", 0, args.wide)] * (ROLLOUT - args.tp * args.tp_groups)
        workers += [fast] * args.tp_groups + train
        rebalancer = Rebalancer(prior_move_s=args.move_s) if mode == "libra" else None
        scheduler = Scheduler("fifo", mlfq=Mlfq(), rebalancer=rebalancer)
    sim = Simulation("fifo", len(workers), jobs(args), seed=seed, worker_specs=workers, scheduler=scheduler,
                     move_s=args.move_s)  # fmt: skip
    return sim.run()


def time_to_last_step(result: SimResult, arrivals: list[float]) -> float:
    return statistics.mean(j.steps_done_s[-1] - a for j, a in zip(result.jobs, arrivals, strict=True))


def sim_part(args: Any) -> dict[str, list[dict[str, float]]]:
    arrivals = [j.arrival_s for j in jobs(args)]
    rows: dict[str, list[dict[str, float]]] = {"static": [], "buckets": [], "libra": []}
    for seed in range(args.repeats):
        for mode in rows:
            started = time.perf_counter()
            r = simulate(mode, args, seed)
            failed = [j.error for j in r.jobs if j.error or j.finished_s is None]
            if failed:
                raise SystemExit(f"{mode} seed {seed}: a job did not finish: {failed[0]}")
            rows[mode].append({
                "samples_per_s": r.trained_samples_per_s, "end_s": r.end_s, "busy": r.busy_fraction,
                "to_last_step_s": time_to_last_step(r, arrivals), "moves": r.role_moves,
                "busy_device_s": sum(r.busy_s.values()),
            })  # fmt: skip
            print(f"  seed {seed} {mode:7s}: {r.trained_samples_per_s:7.2f} samples/s, span {r.end_s:6.0f} s, "
                  f"busy {r.busy_fraction:.2f}, {r.role_moves} role moves ({time.perf_counter() - started:.1f} s)",
                  flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["sim", "real", "both"], default="sim")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=float, default=300.0, help="a turn's median sampled tokens")
    parser.add_argument("--tokens-sigma", type=float, default=1.0)
    parser.add_argument("--tool-median", type=float, default=3.0)
    parser.add_argument("--tool-error-p", type=float, default=0.2)
    parser.add_argument("--hardness", type=float, default=0.8, help="spread of a trajectory's hardness (log space)")
    parser.add_argument("--wide", type=int, default=64, help="sequences a wide bucket's worker decodes at once")
    parser.add_argument("--narrow", type=int, default=16, help="sequences a straggler bucket's worker decodes at once")
    parser.add_argument("--tp", type=int, default=4, help="GPUs per straggler bucket worker (tensor parallel)")
    parser.add_argument("--tp-groups", type=int, default=2, help="straggler bucket workers")
    parser.add_argument("--model", choices=sorted(QWEN3), default="8B")
    parser.add_argument("--move-s", type=float, default=10.0, help="what moving a worker between roles costs")
    parser.add_argument("--out", default="bench-out/libra")
    args = parser.parse_args()
    if args.part in ("real", "both"):
        print("(a) real: not built yet (pooled jobs do not run on real workers yet); no throughput_gain_real")
    if args.part == "real":
        return
    print(f"(b) simulated: {args.jobs} agentic LoRA GRPO jobs on Qwen3-{args.model}, {ROLLOUT + TRAIN} H200s; "
          f"{args.steps} steps of {args.rollouts} trajectories x {args.turns} turns of Lognormal({args.tokens:g}, "
          f"{args.tokens_sigma:g}) tokens, tools Lognormal({args.tool_median:g}, 1) s failing {args.tool_error_p:.0%}; "
          f"seeds 0-{args.repeats - 1}", flush=True)  # fmt: skip
    rows = sim_part(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "libra_sim.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    gain = [lib["samples_per_s"] / st["samples_per_s"] for st, lib in zip(rows["static"], rows["libra"], strict=True)]
    alone = [b["samples_per_s"] / st["samples_per_s"] for st, b in zip(rows["static"], rows["buckets"], strict=True)]
    speedup = [
        st["to_last_step_s"] / lib["to_last_step_s"] for st, lib in zip(rows["static"], rows["libra"], strict=True)
    ]
    for mode, r in rows.items():
        print(f"  {mode:7s}: {spread([x['samples_per_s'] for x in r])} samples/s, time to last step "
              f"{spread([x['to_last_step_s'] for x in r], 0)} s, busy {spread([x['busy'] for x in r])}, "
              f"role moves {spread([x['moves'] for x in r], 0)}")  # fmt: skip
    # The limit: libra's own device-seconds packed onto all the devices without a gap.
    pairs = zip(rows["static"], rows["libra"], strict=True)
    limit = [st["end_s"] * (ROLLOUT + TRAIN) / lib["busy_device_s"] for st, lib in pairs]
    print(f"  throughput gain {spread(gain)} (limit {spread(limit)}: libra's busy device-seconds packed on all "
          f"{ROLLOUT + TRAIN} devices without a gap)")  # fmt: skip
    print(f"  of it, buckets alone (no worker lent): {spread(alone)}")
    print(f"throughput_gain_sim={statistics.mean(gain):.2f} (worst {min(gain):.2f})")
    print(
        f"convergence_speedup={statistics.mean(speedup):.2f} (worst {min(speedup):.2f}; simulated, "
        "from the time to the last step: equal samples per step in both modes)"
    )


if __name__ == "__main__":
    main()
