"""The GPU acceptance check: one prepared script for one GPU, no network, under 8 minutes.

    PYTHONUNBUFFERED=1 python bench/gpu_acceptance.py             # one GPU: Qwen3-1.7B-shaped, bf16
    python bench/gpu_acceptance.py --device cpu --tiny            # every code path on CPU (CI runs it)

Builds a Qwen3-1.7B-shaped model from its published config (``plexrl.models.QWEN3_CONFIGS``,
random weights in bf16; ``--tiny``: the tiny test shape), starts an embedded cluster of one worker
on the device under the ``plex`` policy, and runs 8 LoRA GRPO jobs and 1 full fine-tune job at once,
a few steps each. Completion lengths are long-tailed (each step's length drawn from a Pareto
distribution, most short, a few up to ``--max-tokens``; exact lengths through ``min_tokens``), as
RLVR rollouts are. Rewards are a fixed function of the tokens, so groups have spread and the GRPO
steps change the weights.

Prints, then one line per figure:

- device memory over time, by owner: the worker process (trainer, base models, jobs' state) and
  each of its vLLM engine processes, sampled every ``--sample-s`` (``nvidia-smi`` on a GPU, the
  processes' resident memory on CPU); the peak of each and of their sum;
- sync seconds per job kind (LoRA: an adapter staged in the engine; full: a refit), as the job's
  script waits for them;
- generated tokens/s and trained tokens/s over the run's wall time (all jobs together);
- swaps (jobs' state moved between device and host, and the engines' sleeps and wakes) and the
  seconds they took;
- the engines' sleeps and wakes (``--engine-sleep``, default ``always``: the scheduler sleeps them
  around every training phase, as colocated RL trainers do; ``auto``: only when training does not
  fit beside them), their seconds, and from the coordinator's trace how many training calls ran
  with the engines awake and generates with them asleep;
- ``gpu_acceptance=pass`` or ``gpu_acceptance=fail`` with the reason. It passes when every job ran
  every step, every generate after a sync served the version that sync made, every job's loss is
  finite, the memory samples never exceeded the device, no generate ran while the engines slept,
  and (``always``) every training call ran while they slept.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import plexrl
from plexrl.models import QWEN3_CONFIGS, write_random_model

GiB = 1 << 30


@dataclass
class Record:
    """What the jobs saw, appended from their tasks (one event loop: no locks needed)."""

    sync_s: dict[str, list[float]] = field(default_factory=lambda: {"lora": [], "full": []})
    generated_tokens: int = 0
    trained_tokens: int = 0
    steps_done: dict[str, int] = field(default_factory=dict)
    swaps: dict[str, tuple[int, float]] = field(default_factory=dict)  # by job: (swaps, seconds) charged it
    problems: list[str] = field(default_factory=list)


class MemorySampler(threading.Thread):
    """The device memory of a worker process and of its child processes (its vLLM engines), sampled
    every ``interval_s``: ``nvidia-smi``'s per-process figures on a GPU, resident memory on CPU."""

    def __init__(self, worker_pid: int, device: str, interval_s: float) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.worker_pid, self.device, self.interval_s = worker_pid, device, interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []  # (seconds since start, bytes by owner)
        self.capacity = _capacity(device)
        self._done = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._done.wait(self.interval_s):
            self.samples.append((time.monotonic() - t0, self.sample()))

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)

    def owners(self) -> dict[int, str]:
        return {self.worker_pid: "worker", **{pid: f"engine {pid}" for pid in _children(self.worker_pid)}}

    def sample(self) -> dict[str, int]:
        owners = self.owners()
        if self.device.startswith("cuda"):
            used = _nvidia_smi_bytes()
            return {name: used.get(pid, 0) for pid, name in owners.items()}
        return {name: _rss_bytes(pid) for pid, name in owners.items()}

    def peaks(self) -> dict[str, int]:
        peaks: dict[str, int] = {}
        for _, by_owner in self.samples:
            for owner, used in by_owner.items():
                peaks[owner] = max(peaks.get(owner, 0), used)
            peaks["total"] = max(peaks.get("total", 0), sum(by_owner.values()))
        return peaks


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task")
        return sorted({int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()})
    except OSError:
        return []


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _nvidia_smi_bytes() -> dict[int, int]:
    """Device memory by process id, as the driver counts it (every process on the machine's GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    used = {}
    for line in out.stdout.splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        if pid.isdigit() and mib.isdigit():
            used[int(pid)] = int(mib) << 20
    return used


def _capacity(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_model(out: Path, tiny: bool) -> Path:
    """A Qwen3-1.7B-shaped model with random bf16 weights (``tiny``: the tiny test shape, float32)."""
    if tiny:
        return write_random_model(out / "tiny", seed=0)
    shape = {**QWEN3_CONFIGS["1.7B"], "pad_token_id": 151643}
    return write_random_model(out / "qwen3-1.7b-shaped", seed=0, shape=shape, dtype="bfloat16")


def reward(tokens: list[int]) -> float:
    """A fixed, verifiable function of the tokens: the share of even token ids."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


async def run_job(name: str, kind: str, model: Path, args: argparse.Namespace, seed: int, record: Record) -> None:
    rng = np.random.default_rng(seed)
    vocab = int(plexrl_config(model)["vocab_size"])
    lora = plexrl.LoRA(rank=8) if kind == "lora" else None
    optimizer = plexrl.AdamW(lr=1e-5 if kind == "full" else 1e-4)
    async with plexrl.job(name, model=model, lora=lora, optimizer=optimizer, seed=seed) as job:
        record.steps_done[name] = 0
        for step in range(args.steps):
            prompts = [rng.integers(3, vocab, size=int(rng.integers(8, 32))).tolist() for _ in range(args.prompts)]
            # Long-tailed: most steps short, a few up to max_tokens (Pareto, shape 1.2).
            length = int(min(args.max_tokens, args.min_tokens * (1 + rng.pareto(1.2))))
            params = plexrl.SamplingParams(n=args.group, max_tokens=length, min_tokens=length, temperature=1.0)
            out = await plexrl.generate(prompts, params)
            if out.weight_version != step:
                record.problems.append(f"{name} step {step}: generate served version {out.weight_version}")
            record.generated_tokens += sum(len(s.tokens) for s in out.samples)
            rewards = [reward(s.tokens.tolist()) for s in out.samples]
            result = await plexrl.optimize(plexrl.grpo_batch(prompts, out, rewards), loss="grpo")
            if not math.isfinite(result.loss):
                record.problems.append(f"{name} step {step}: loss {result.loss}")
            record.trained_tokens += sum(len(s.tokens) + len(prompts[s.prompt_index]) for s in out.samples)
            t0 = time.perf_counter()
            synced = await job.sync_weights()
            record.sync_s[kind].append(time.perf_counter() - t0)
            if synced.weight_version != step + 1:
                record.problems.append(f"{name} step {step}: sync made version {synced.weight_version}")
            record.steps_done[name] = step + 1
            print(f"  {name:6} step {step + 1}/{args.steps}  {length:5d} tokens x {len(out.samples)}", flush=True)
        stats = await job.stats()  # before it closes: what the coordinator charged it
        record.swaps[name] = (stats.swaps, stats.swap_s)


def plexrl_config(model: Path) -> dict[str, Any]:
    import json

    return dict(json.loads((model / "config.json").read_text()))


async def main(args: argparse.Namespace) -> bool:
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plexrl-gpu-acceptance-") as tmp:
        print(f"building the model ({'tiny' if args.tiny else 'Qwen3-1.7B-shaped, bf16'}) ...", flush=True)
        model = build_model(Path(tmp), args.tiny)
        record = Record()
        cluster = plexrl.local(
            workers=1, device=args.device, policy="plex", start_timeout_s=600, engine_sleep=args.engine_sleep
        )
        async with cluster as client:
            (worker,) = (await client.status(min_workers=1)).workers
            sampler = MemorySampler(worker.pid, args.device, args.sample_s)
            sampler.start()
            print(
                f"worker {worker.name} on {worker.device}, engines {worker.engines}; running {args.lora_jobs} LoRA + {args.full_jobs} full jobs"
            )
            t0 = time.perf_counter()
            jobs = [(f"lora{i}", "lora") for i in range(args.lora_jobs)] + [("full0", "full")] * args.full_jobs
            outcomes = await asyncio.gather(
                *(run_job(name, kind, model, args, seed, record) for seed, (name, kind) in enumerate(jobs)),
                return_exceptions=True,
            )
            wall = time.perf_counter() - t0
            sampler.stop()
            spans = (await client.trace()).spans
        for (name, _), outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                record.problems.append(f"{name} failed: {type(outcome).__name__}: {outcome}")
    return report(args, record, sampler, spans, wall, time.perf_counter() - t_start)


TRAINING = ("forward_backward", "optim_step", "logprobs")


def engine_checks(spans: list[Any]) -> tuple[dict[str, list[float]], int, int]:
    """From the coordinator's trace: the engines' sleep and wake seconds, and how many training
    calls ran while they were awake and generates while they slept (asleep: from a sleep's end to
    the next wake's start; one worker)."""
    seconds: dict[str, list[float]] = {"sleep": [], "wake": []}
    asleep: list[tuple[float, float]] = []
    for span in sorted((s for s in spans if s.kind in seconds), key=lambda s: s.start_s):
        seconds[span.kind].append(span.end_s - span.start_s)
        if span.kind == "sleep":
            asleep.append((span.end_s, math.inf))
        elif asleep and asleep[-1][1] == math.inf:
            asleep[-1] = (asleep[-1][0], span.start_s)

    def inside(s: Any) -> bool:
        return any(a <= s.start_s and s.end_s <= b for a, b in asleep)

    def overlaps(s: Any) -> bool:
        return any(s.start_s < b and a < s.end_s for a, b in asleep)

    awake_training = sum(1 for s in spans if s.kind in TRAINING and not inside(s))
    asleep_generates = sum(1 for s in spans if s.kind == "generate" and overlaps(s))
    return seconds, awake_training, asleep_generates


def report(
    args: argparse.Namespace,
    record: Record,
    sampler: MemorySampler,
    spans: list[Any],
    wall: float,
    total: float,
) -> bool:
    print(f"\n{'':2}{'figure':52} {'value':>12} unit")

    def line(what: str, value: float | str, unit: str = "") -> None:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {what:52} {text:>12} {unit}")

    peaks = sampler.peaks()
    line("memory samples", len(sampler.samples), f"every {args.sample_s} s")
    for owner, peak in sorted(peaks.items()):
        line(f"peak memory: {owner}", peak / GiB, "GiB")
    line("device capacity", sampler.capacity / GiB, "GiB")
    timeline = [
        f"{t:.0f}s:{sum(b.values()) / GiB:.1f}" for t, b in sampler.samples[:: max(1, len(sampler.samples) // 12)]
    ]
    line("memory over time (s:GiB, sum of owners)", " ".join(timeline) or "no samples")
    for kind, times in record.sync_s.items():
        if times:
            line(f"sync seconds, {kind} (mean [min-max] of {len(times)})", f"{np.mean(times):.3f} "
                 f"[{min(times):.3f}-{max(times):.3f}]", "s")  # fmt: skip
    line("generated tokens/s (all jobs, run wall time)", record.generated_tokens / wall, "tokens/s")
    line("trained tokens/s (all jobs, run wall time)", record.trained_tokens / wall, "tokens/s")
    line("swaps (jobs' state device<->host, engines' sleeps and wakes)", sum(n for n, _ in record.swaps.values()))
    line("swap seconds (charged to the jobs)", float(sum(t for _, t in record.swaps.values())), "s")
    moves, awake_training, asleep_generates = engine_checks(spans)
    for kind, times in moves.items():
        value = f"{np.mean(times):.3f} [{min(times):.3f}-{max(times):.3f}]" if times else "none"
        line(f"engine {kind} seconds (mean [min-max] of {len(times)})", value, "s")
    slept = "(on CPU a sleep pauses the engine)" if not args.device.startswith("cuda") else ""
    line(f"training calls with the engines awake (--engine-sleep {args.engine_sleep})", awake_training, slept)
    line("generates with the engines asleep", asleep_generates)
    line("run wall time (jobs)", wall, "s")
    line("script wall time (model built, cluster started and stopped)", total, "s")
    expected = args.lora_jobs + args.full_jobs
    short = {n: d for n, d in record.steps_done.items() if d < args.steps}
    if len(record.steps_done) < expected:
        record.problems.append(f"only {len(record.steps_done)} of {expected} jobs opened")
    if short:
        record.problems.append(f"jobs short of {args.steps} steps: {short}")
    if peaks.get("total", 0) > sampler.capacity:
        record.problems.append(f"memory peaked at {peaks['total'] / GiB:.1f} GiB, over the device's capacity")
    if not sampler.samples:
        record.problems.append("no memory sample was taken")
    if moves["sleep"] and not any(n for n, _ in record.swaps.values()):
        record.problems.append("the engines slept, but no job was charged a sleep or a wake")
    if asleep_generates:
        record.problems.append(f"{asleep_generates} generates ran while the engines slept")
    if args.engine_sleep == "always" and (awake_training or not moves["sleep"]):
        record.problems.append(
            f"{awake_training} training calls ran with the engines awake under --engine-sleep always"
        )
    ok = not record.problems
    reason = "every job ran every step on the versions its syncs made" if ok else "; ".join(record.problems[:5])
    print(f"\ngpu_acceptance={'pass' if ok else 'fail'} ({reason})", flush=True)
    return ok


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="the tiny test model instead of Qwen3-1.7B's shape")
    p.add_argument("--lora-jobs", type=int, default=8)
    p.add_argument("--full-jobs", type=int, default=1, choices=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per job (default 4; --tiny: 2)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; --tiny: 2)")
    p.add_argument("--group", type=int, default=None, help="completions per prompt (default 8; --tiny: 4)")
    p.add_argument("--min-tokens", type=int, default=None, help="the length most steps sample (default 64; --tiny: 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="the tail's cap (default 1024; --tiny: 32)")
    p.add_argument("--sample-s", type=float, default=0.5, help="memory sampling interval")
    p.add_argument(
        "--engine-sleep",
        choices=["always", "auto", "never"],
        default="always",
        help="the worker's --engine-sleep (always: the engines sleep around every training phase)",
    )
    args = p.parse_args(argv)
    defaults = {"steps": (4, 2), "prompts": (8, 2), "group": (8, 4), "min_tokens": (64, 4), "max_tokens": (1024, 32)}
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


if __name__ == "__main__":
    raise SystemExit(0 if asyncio.run(main(parse())) else 1)
