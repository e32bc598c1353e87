"""How fast the simulator runs a large cluster: 1024 devices, 256 jobs, a simulated day.

    python bench/sim_scale.py [--devices 1024] [--jobs 256] [--hours 24]

Runs the coordinator's scheduler on virtual time (``plexrl.sim``) with the default agentic
``JobModel`` (3 generate + tool rounds per step), under ``fifo`` (no memory budget) and under
``plex`` (80 GB devices, 30 GB of state per job: placement packs two jobs per device), and prints
the wall seconds each took next to the simulated hours and the calls simulated.
"""

from __future__ import annotations

import argparse
import time

from plexrl.sim import JobModel, Simulation


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
    print(f"{args.devices} devices, {args.jobs} jobs, {args.hours:g} simulated hours")
    print(f"{'policy':>6} {'wall s':>7} {'calls':>9} {'calls/s':>8} {'devices used':>12} {'swaps':>6}")
    for policy, (job, options) in runs.items():
        t0 = time.perf_counter()
        result = Simulation(policy, args.devices, [job] * args.jobs, seed=0, **options).run(until_s=3600 * args.hours)
        wall = time.perf_counter() - t0
        calls = sum(j.calls for j in result.jobs)
        print(f"{policy:>6} {wall:>7.1f} {calls:>9} {calls / wall:>8.0f} {len(result.held_s):>12} {result.swaps:>6}")


if __name__ == "__main__":
    main()
