"""A client process for the multi-client test: one job, calls pipelined without awaiting.

Prints the weight version each call reports, in submission order, as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

import plexrl


async def main(address: str, model: str, name: str, rounds: int) -> None:
    async with plexrl.connect(address), plexrl.job(name, model=model, lora=plexrl.LoRA(rank=4)) as job:
        greedy = plexrl.SamplingParams(max_tokens=3, temperature=0.0)
        futures: list[asyncio.Future] = []
        for _ in range(rounds):
            futures.append(job.generate([[1, 5, 6]], greedy))
            futures.append(job.sync_weights())
        results = await asyncio.gather(*futures)
    print(json.dumps([r.weight_version for r in results]), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
