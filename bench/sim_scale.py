"""How fast the simulator runs a large cluster: 1024 devices, 256 jobs, a simulated day.

    python bench/sim_scale.py [--devices 1024] [--jobs 256] [--hours 24]

Runs the coordinator's scheduler on virtual time (``plexrl.sim``) with the default agentic
``JobModel`` (3 generate + tool rounds per step), under ``fifo`` (no memory budget) and under
``plex`` (80 GB devices, 30 GB of state per job: placement packs two jobs per device), and prints
the wall seconds each took next to the simulated hours and the calls simulated.

A quarter of the jobs span worker groups (nodes of 8 devices): of every 16 jobs, two full
fine-tunes of Qwen3-4B on 2 GPUs, one of Qwen3-8B on 4 and one of Qwen3-14B on 8 (FSDP trainer,
tensor-parallel sampler; ``sim/costs.py``, ``group_job``: 37, 37 and 33 GB of state a GPU). The
second table prints, per group size, the jobs, the devices they hold and their optimizer steps.
"""

from __future__ import annotations

import argparse
import time

from plexrl.sim import JobModel, SimResult, Simulation
from plexrl.sim.costs import QWEN3, group_job

MIX = [1] * 12 + [2, 2, 4, 8]  # devices of each job, repeated over the jobs
GROUP_MODEL = {2: "4B", 4: "8B", 8: "14B"}


def jobs(count: int, single: JobModel) -> list[JobModel]:
    groups = {k: group_job(f"fsdp{k}", QWEN3[size], k, steps=10**9) for k, size in GROUP_MODEL.items()}
    return [single if MIX[i % len(MIX)] == 1 else groups[MIX[i % len(MIX)]] for i in range(count)]


def by_size(result: SimResult) -> dict[int, tuple[int, int, int]]:
    """Per group size: jobs, devices they hold, optimizer steps they finished."""
    rows: dict[int, tuple[int, int, int]] = {}
    for j in result.jobs:
        k = len(j.members) or 1
        n, held, steps = rows.get(k, (0, 0, 0))
        rows[k] = (n + 1, held + k, steps + len(j.steps_done_s))
    return dict(sorted(rows.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args()
    runs = {
        "fifo": (JobModel("agent", steps=10**9, turns=3), {}),
        "plex": (JobModel("agent", steps=10**9, turns=3, state_bytes=30 * 10**9), {"memory_bytes": 80e9}),
    }
    print(f"{args.devices} devices, {args.jobs} jobs ({1 - MIX.count(1) / len(MIX):.0%} on groups of 2/4/8), "
          f"{args.hours:g} simulated hours")  # fmt: skip
    print(f"{'policy':>6} {'wall s':>7} {'calls':>9} {'calls/s':>8} {'devices used':>12} {'swaps':>6}")
    results: dict[str, SimResult] = {}
    for policy, (job, options) in runs.items():
        t0 = time.perf_counter()
        result = Simulation(policy, args.devices, jobs(args.jobs, job), seed=0, **options).run(
            until_s=3600 * args.hours
        )
        wall = time.perf_counter() - t0
        calls = sum(j.calls for j in result.jobs)
        print(f"{policy:>6} {wall:>7.1f} {calls:>9} {calls / wall:>8.0f} {len(result.held_s):>12} {result.swaps:>6}")
        results[policy] = result
    print(f"\n{'policy':>6} {'group':>5} {'jobs':>5} {'devices':>7} {'steps':>8} {'steps/job':>9} {'busy':>5}")
    for policy, result in results.items():
        for k, (n, held, steps) in by_size(result).items():
            members = {m for j in result.jobs if len(j.members or (j.worker,)) == k for m in (j.members or (j.worker,))}
            busy = sum(result.busy_s[w] for w in members) / sum(result.held_s.get(w, 0.0) for w in members)
            print(f"{policy:>6} {k:>5} {n:>5} {held:>7} {steps:>8} {steps / n:>9.1f} {busy:>5.2f}")


if __name__ == "__main__":
    main()
