"""What plexrl adds to a call: client -> coordinator -> worker -> back, against the same call
made directly on the engine in this process.

    python bench/overhead.py [--calls 300]

Blocks of direct and service calls alternate so drift hits both alike; this process runs torch
like a worker does (same thread count, passive OpenMP waits). Two measures per call kind:
``added`` = p50(service) - p50(direct), and ``around`` = p50 of (service latency - the engine time
the worker reported for that same call), i.e. transport + scheduling alone. ``added`` also carries
the difference between two processes' compute times, which on a shared 2-core VM swings by more
than the overhead itself, so the last line, ``overhead_ms_p50=<number>``, is the larger
``around`` of the two kinds.

For scale, the same run measures the wire's floor for this topology: bare pyzmq, no decoding, a
relay process in the coordinator's place and an echo process that spins for the same compute
time in the worker's place. Client and relay sleep while the worker computes, and waking a
sleeping process costs far more on a VM than on bare metal; that floor is what no design with a
separate coordinator process can go under.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `plexrl worker` does, before torch loads

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

import plexrl
from plexrl.client.connection import expect
from plexrl.models import write_random_model
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.types import Batch, LossConfig, Ragged, SamplingParams
from plexrl.worker.engine import Engine

PROMPTS = Ragged.from_rows([[1, 5, 6, 7]], "int32")
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
BATCH = Batch(
    tokens=Ragged.from_rows([[1, 5, 6, 7, 8, 9, 10, 11]] * 2, "int32"), prompt_lens_B=np.array([3, 3], np.int32)
)
CALLS: dict[str, calls.Call] = {
    "generate": calls.Generate(prompts=PROMPTS, params=PARAMS),
    "forward_backward": calls.ForwardBackward(batch=BATCH, loss="cross_entropy", loss_config=LossConfig()),
}


def _relay(address: str) -> None:
    """The coordinator's place in the floor measurement: forward client <-> worker, nothing else."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    worker, client = b"", b""
    while True:
        ident, body = sock.recv_multipart()
        if body == b"register":
            worker = ident
        elif not worker:
            continue  # no worker yet: the client retries
        elif ident == worker:
            sock.send_multipart([client, body])
        else:
            client = ident
            sock.send_multipart([worker, body])


def _echo(address: str, compute_s: float) -> None:
    """The worker's place: spin (a core stays busy, as with real compute) and echo."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"register")
    while True:
        body = sock.recv()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < compute_s:
            pass
        sock.send(body)


def wire_floor(compute_s: float, n_calls: int) -> list[float]:
    """Round trips minus compute through bare pyzmq in the plexrl topology (3 processes, 4 hops)."""
    address = f"ipc://{tempfile.mkdtemp()}/floor"
    me = [sys.executable, __file__]
    procs = [subprocess.Popen([*me, "--role", "relay", address])]
    procs.append(subprocess.Popen([*me, "--role", "echo", address, "--compute-s", str(compute_s)]))
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    out = []
    try:
        for _ in range(120):  # until the echo process has started and registered
            sock.send(b"x" * 64)
            if sock.poll(1000):
                sock.recv()
                break
        else:
            raise RuntimeError("the floor measurement's echo process never registered")
        for i in range(n_calls + 10):
            t0 = time.perf_counter()
            sock.send(b"x" * 64)
            if not sock.poll(10_000):
                raise RuntimeError("the floor measurement's relay or echo process did not answer")
            sock.recv()
            if i >= 10:
                out.append(time.perf_counter() - t0 - compute_s)
    finally:
        sock.close()
        for p in procs:
            p.kill()
            p.wait()
    return out


def _ms(xs: list[float]) -> tuple[float, float]:
    a = np.array(xs) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 90))


async def main(n_calls: int, block: int) -> None:
    model = write_random_model(Path(tempfile.mkdtemp()) / "tiny")
    spec = calls.JobSpec(model=str(model))
    engine = Engine()
    engine.execute("direct", calls.Open(spec=spec))
    direct: dict[str, list[float]] = {k: [] for k in CALLS}
    service: dict[str, list[float]] = {k: [] for k in CALLS}
    around: dict[str, list[float]] = {k: [] for k in CALLS}
    async with plexrl.local(workers=1) as client, plexrl.job("bench", model=model) as job:
        for kind, call in CALLS.items():  # warm-up both paths
            for _ in range(10):
                engine.execute("direct", call)
                await client.submit(
                    job.job_id, call, calls.Generated if kind == "generate" else calls.ForwardBackwardResult
                )
        for start in range(0, n_calls, block):
            for kind, call in CALLS.items():
                for _ in range(min(block, n_calls - start)):
                    t0 = time.perf_counter()
                    engine.execute("direct", call)
                    direct[kind].append(time.perf_counter() - t0)
                for _ in range(min(block, n_calls - start)):
                    t0 = time.perf_counter()
                    done = await client.request(m.Submit(job_id=job.job_id, call=call), expect(m.CallDone))
                    service[kind].append(time.perf_counter() - t0)
                    around[kind].append(service[kind][-1] - done.compute_s)
    compute_s = float(
        np.median([x for k in CALLS for x in service[k]]) - np.median([x for k in CALLS for x in around[k]])
    )
    floor = wire_floor(compute_s, n_calls)
    print(
        f"{'call':18} {'direct p50':>11} {'plexrl p50':>11} {'added p50':>10} {'around p50':>11} "
        f"{'direct p90':>11} {'plexrl p90':>11}  (ms, {n_calls} calls each)"
    )
    worst = 0.0
    for kind in CALLS:
        (d50, d90), (s50, s90), (a50, _) = _ms(direct[kind]), _ms(service[kind]), _ms(around[kind])
        worst = max(worst, a50)
        print(f"{kind:18} {d50:>11.3f} {s50:>11.3f} {s50 - d50:>10.3f} {a50:>11.3f} {d90:>11.3f} {s90:>11.3f}")
    f50, f90 = _ms(floor)
    print(f"{'bare zmq floor':18} {'':>11} {'':>11} {'':>10} {f50:>11.3f} {'':>11} {f90:>11.3f}")
    print(f"(floor: same 4 hops, {compute_s * 1e3:.0f} ms of spinning compute; plexrl above it: {worst - f50:.3f} ms)")
    print(f"overhead_ms_p50={worst:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--role", nargs="?", choices=["relay", "echo"], help=argparse.SUPPRESS)
    parser.add_argument("address", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--compute-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "relay":
        _relay(args.address)
    elif args.role == "echo":
        _echo(args.address, args.compute_s)
    else:
        asyncio.run(main(args.calls, args.block))
