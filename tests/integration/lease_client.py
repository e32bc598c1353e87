"""A client that opens a job, trains it one version, says so and then waits to be killed
(test_leases.py). Its key comes from $PLEXRL_KEY / $PLEXRL_COORDINATOR_KEY."""

from __future__ import annotations

import asyncio
import sys

import plexrl
from plexrl.protocol import calls


async def main(address: str, model: str) -> None:
    async with plexrl.connect(address) as client:
        job_id, _ = await client.open_job("leased", calls.JobSpec(model=model))
        synced = await client.submit(job_id, calls.SyncWeights(), plexrl.Synced)
        print(job_id, synced.weight_version, flush=True)
        await asyncio.Event().wait()  # until killed: its job must outlive it


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
