"""A full model's weights from a job's home worker to its sampler worker: over the workers' data
plane (worker/dataplane.py) against through the coordinator (``--weights-via coordinator``, the
path before it), on hosts with links of a set bandwidth.

    python bench/weights.py [--reps 3] [--syncs 3] [--mbit 1000]     (root: network namespaces)
    python bench/weights.py --only refit                               (no root: one machine)

The hosts are network namespaces on this machine (client/hosts.py), each sending at most
``--mbit`` (a token bucket on its link; 1000 = the gigabit network of a workstation cluster).
Two topologies:

* ``same host``: the coordinator on a host of its own, the job's home and sampler workers on one
  host (a GPU node's trainer and sampler replica); the data plane stays on that host (a Unix
  socket, unencrypted: nothing crosses a network), the coordinator's path crosses the network
  twice, encrypted (CurveZMQ, as every connection to the coordinator is);
* ``other hosts``: home and sampler on two hosts; both paths cross the network, the coordinator's
  twice (store and forward), so the most it can lose by is about 2x.

The job is a disaggregated full fine-tune of a ~103 MB float32 model (Qwen2, hidden 512, 8
layers). Two measures: the push (``Synced.push_s``, timed by the workers: from the weights
exported on the home worker to them in the sampler worker's memory; on one machine the hosts
share a clock), and the user's ``sync_weights``, from call to the sampler serving the new weights
(which adds the export and vLLM's reload, the same in both modes: on CPU vLLM reloads weights from
a file, about a second for this model). Each rep
starts a fresh cluster per mode (modes alternate, so drift hits both), takes ``--syncs`` timed
syncs after one warm-up, and keeps their median; reps give the spread. Beside it, the link's copy
bandwidth: one 103 MB ZeroMQ message between the same hosts, nothing else. The last line,
``same_host_push_speedup=<median>``, is the headline.

``refit`` (first, and alone with ``--only refit``): the last hop of a full fine-tune's sync, the
weights into the job's vLLM engine, the way the sampler does it (``VllmSampler.refit``: safetensors
buckets of at most 256 MiB handed to vLLM's worker in memory, ``extension.py``) against the path
before it (the state dict written as one safetensors file to ``/dev/shm`` and read back by vLLM's
``reload_weights``, rebuilt here from vLLM's public calls). Same engine, same tensors (new values
each time), modes alternating; seconds and seconds per GB, median [range] of the reps' medians.
Last line: ``refit_in_memory_s_per_gb=``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import plexrl
from plexrl.client import hosts
from plexrl.models import write_random_model

BIG = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 8,
       "intermediate_size": 1664}  # fmt: skip
PROMPTS = [[1, 5, 6, 7], [1, 9, 10]]
MODES = ("workers", "coordinator")


def _copy_server(address: str, nbytes: int) -> None:
    """Answer each request with ``nbytes`` in one message (run on the sending host)."""
    sock = zmq.Context().socket(zmq.REP)
    sock.bind(address)
    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    print("ready", flush=True)
    while sock.recv() != b"stop":
        sock.send(payload.data, copy=False)
    sock.send(b"")


def _copy_client(address: str, reps: int) -> None:
    """Ask for the payload ``reps`` times; print each transfer's seconds (run on the receiving host)."""
    sock = zmq.Context().socket(zmq.REQ)
    sock.connect(address)
    for _ in range(reps + 1):  # the first one opens the connection
        start = time.perf_counter()
        sock.send(b"go")
        sock.recv(copy=False)
        print(time.perf_counter() - start, flush=True)
    sock.send(b"stop")
    sock.recv()


def link_copy_s(source: hosts.Host, sink: hosts.Host, nbytes: int, reps: int) -> list[float]:
    """Seconds one ``nbytes`` message takes from ``source`` to ``sink`` (bare ZeroMQ, no decoding)."""
    address = f"tcp://{source.address}:7399"
    me = [sys.executable, __file__]
    server = subprocess.Popen(source.command([*me, "--copy-server", address, str(nbytes)]), stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        out = subprocess.run(
            sink.command([*me, "--copy-client", address, str(reps)]), capture_output=True, text=True, check=True
        ).stdout
        return [float(x) for x in out.split()][1:]
    finally:
        server.wait(timeout=30)


async def sync_seconds(model: Path, net: hosts.Network, mode: str, syncs: int) -> tuple[float, float]:
    """The median seconds of the push (``Synced.push_s``: from the export on the home worker to the
    weights in the sampler worker's memory) and of the whole ``sync_weights`` call, over ``syncs``
    timed syncs of a disaggregated full fine-tune job on a fresh cluster (after one warm-up)."""
    cluster = plexrl.local(
        workers=2, hosts=net.hosts, weights_via=mode, max_message_bytes=1 << 28, snapshot_max_bytes=0
    )
    async with cluster, plexrl.job("push", model, lora=None, placement="disaggregated", seed=1) as job:
        seconds, pushes = [], []
        for i in range(syncs + 1):  # an on-policy GRPO step; only the sync is timed
            out = await job.generate(PROMPTS, plexrl.SamplingParams(n=2, max_tokens=4, temperature=1.0))
            assert out.weight_version == i  # the sampler serves the weights of the last sync
            await job.optimize(plexrl.grpo_batch(PROMPTS, out, [float(k % 2) for k in range(len(out.samples))]))
            start = time.perf_counter()
            synced = await job.sync_weights()
            if i:
                seconds.append(time.perf_counter() - start)
                pushes.append(synced.push_s)
    return statistics.median(pushes), statistics.median(seconds)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} [{min(xs):.2f}-{max(xs):.2f}]"


async def topology(name: str, model: Path, net: hosts.Network, args: argparse.Namespace) -> list[float]:
    home, sampler = net.hosts[1], net.hosts[-1]  # same host: both are net.hosts[1]
    nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    to_coordinator = link_copy_s(home, net.hosts[0], nbytes, 3)
    direct = link_copy_s(home, sampler, nbytes, 3)
    print(f"\n{name}: {len(net.hosts)} hosts, {args.mbit} Mbit/s links", flush=True)
    print(f"  link copy, home -> coordinator's host: {nbytes / statistics.median(to_coordinator) / 1e6:7.1f} MB/s")
    print(f"  link copy, home -> sampler's host:     {nbytes / statistics.median(direct) / 1e6:7.1f} MB/s")
    push: dict[str, list[float]] = {mode: [] for mode in MODES}
    sync: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            p, s = await sync_seconds(model, net, mode, args.syncs)
            push[mode].append(p)
            sync[mode].append(s)
            print(f"  rep {rep + 1}/{args.reps} {mode:>11}: push {p:.2f} s, sync_weights {s:.2f} s", flush=True)
    speedups = [c / w for w, c in zip(push["workers"], push["coordinator"], strict=True)]
    sync_speedups = [c / w for w, c in zip(sync["workers"], sync["coordinator"], strict=True)]
    bound = statistics.median(to_coordinator) * 2 / statistics.median(direct)
    print(f"  {'path':<24} {'push s, median [range]':>24} {'MB/s':>7} {'sync_weights s':>24}")
    for mode in MODES:
        label = "worker -> worker" if mode == "workers" else "through the coordinator"
        mb_s = nbytes / statistics.median(push[mode]) / 1e6
        print(f"  {label:<24} {_spread(push[mode]):>24} {mb_s:7.1f} {_spread(sync[mode]):>24}")
    print(f"  push speedup (paired by rep): {_spread(speedups)}x; sync_weights: {_spread(sync_speedups)}x")
    print(f"  limit (bare link copies): 2 x home -> coordinator / home -> sampler = {bound:.1f}x")
    return speedups


def refit_seconds(sampler: Any, tensors: dict[str, Any], mode: str, model: Path) -> float:
    """One refit of ``tensors`` into ``sampler``'s engine: ``memory`` (the sampler's own path) or
    ``file`` (the path before it: a safetensors file in /dev/shm, vLLM's reload_weights reads it)."""
    import shutil

    from safetensors.torch import save_file

    start = time.perf_counter()
    if mode == "memory":
        sampler.refit(tensors)
        return time.perf_counter() - start
    folder = Path(tempfile.mkdtemp(prefix="plexrl-refit-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, folder / "model.safetensors")
        for name in ("config.json", "generation_config.json"):
            if (model / name).is_file():
                shutil.copy(model / name, folder / name)
        kwargs = {"weights_path": str(folder), "is_checkpoint_format": True}
        sampler._call(sampler._engine.collective_rpc("reload_weights", kwargs=kwargs), 600)
        sampler._call(sampler._engine.reset_prefix_cache(), 60)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def refit(model: Path, args: argparse.Namespace) -> float:
    """In-memory refits against file refits on one engine; returns the in-memory seconds per GB."""
    import torch
    from safetensors.torch import load_file

    from plexrl.worker.sampler.vllm import VllmSampler

    base = load_file(model / "model.safetensors")
    if "lm_head.weight" not in base:  # what the sampler adds for a tied model, so both modes move the same bytes
        base["lm_head.weight"] = base["model.embed_tokens.weight"].clone()
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    sampler = VllmSampler(str(model), "cpu", lora=False)
    seconds: dict[str, list[float]] = {"memory": [], "file": []}
    try:
        step = 0
        for rep in range(args.reps):
            for mode in ("memory", "file") if rep % 2 == 0 else ("file", "memory"):
                times = []
                for _ in range(args.syncs + 1):  # the first one warms up
                    step += 1
                    tensors = {k: t + torch.full_like(t, 1e-4 * step) for k, t in base.items()}
                    times.append(refit_seconds(sampler, tensors, mode, model))
                seconds[mode].append(statistics.median(times[1:]))
                print(f"  refit rep {rep + 1}/{args.reps} {mode:>6}: {seconds[mode][-1]:.3f} s", flush=True)
    finally:
        sampler.close()
    gb = nbytes / 1e9
    print(f"\nrefit of {gb * 1e3:.0f} MB into a full fine-tune's vLLM engine (CPU), {args.reps} reps x {args.syncs}")
    for mode, label in (("memory", "in memory, 256 MiB buckets"), ("file", "a /dev/shm file (before)")):
        per_gb = [s / gb for s in seconds[mode]]
        print(f"  {label:<28} {_spread(seconds[mode])} s   {_spread(per_gb)} s/GB")
    ratio = [f / m for m, f in zip(seconds["memory"], seconds["file"], strict=True)]
    print(f"  file / in memory (paired by rep): {_spread(ratio)}x")
    return statistics.median(seconds["memory"]) / gb


async def main(args: argparse.Namespace) -> None:
    model = write_random_model(Path(tempfile.mkdtemp()) / "big", seed=0, **BIG)
    if args.only in (None, "refit"):
        per_gb = refit(model, args)
        if args.only == "refit":
            print(f"refit_in_memory_s_per_gb={per_gb:.3f}")
            return
    if (why := hosts.available()) is not None:
        sys.exit(f"bench/weights.py makes network namespaces: {why}")
    nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"model: {nbytes / 1e6:.1f} MB of float32 weights; {args.reps} reps x {args.syncs} syncs per mode")
    results = {}
    topologies = (("other hosts", 3), ("same host", 2))  # the headline last
    for name, count in [(n, c) for n, c in topologies if args.only in (None, n.split()[0])]:
        with hosts.Network(count, prefix="plexw") as net:
            for host in net.hosts:
                host.shape(args.mbit)
            results[name] = await topology(name, model, net, args)
    print()
    if args.only is None:
        print(f"refit_in_memory_s_per_gb={per_gb:.3f}")
    for name, speedups in results.items():
        print(
            f"{name.replace(' ', '_')}_push_speedup={statistics.median(speedups):.2f} (worst rep {min(speedups):.2f})"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--copy-server":
        _copy_server(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--copy-client":
        _copy_client(sys.argv[2], int(sys.argv[3]))
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--reps", type=int, default=3)
        parser.add_argument("--syncs", type=int, default=3, help="timed syncs per cluster (their median is a rep)")
        parser.add_argument("--mbit", type=int, default=1000, help="each host's link, Mbit/s")
        parser.add_argument("--only", choices=["same", "other", "refit"], default=None, help="one part")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        asyncio.run(main(parser.parse_args()))
