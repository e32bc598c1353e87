"""A client that opens a job, trains it one version and says so (test_leases.py); then, for each
line on its stdin, publishes one more version and prints it, until killed or stdin closes. Its
key comes from $PLEXRL_KEY / $PLEXRL_COORDINATOR_KEY."""

from __future__ import annotations

import asyncio
import sys

import plexrl


async def main(address: str, model: str) -> None:
    loop = asyncio.get_running_loop()
    async with plexrl.connect(address) as client, plexrl.job("leased", model, client=client) as job:
        print(job.job_id, (await job.sync_weights()).weight_version, flush=True)
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(job.job_id, (await job.sync_weights()).weight_version, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
