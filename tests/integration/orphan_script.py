"""Starts an embedded cluster, prints its children's pids, then waits to be killed."""

import asyncio

import plexrl


async def main() -> None:
    cluster = plexrl.local(workers=1)
    async with cluster:
        assert cluster.coordinator is not None
        pids = [cluster.coordinator.pid, *(p.pid for p in cluster.worker_processes)]
        print(" ".join(map(str, pids)), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
