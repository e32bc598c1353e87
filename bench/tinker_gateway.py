"""What the Tinker gateway adds to a call over plexrl's own client, on the same cluster in one run.

    python bench/tinker_gateway.py [--calls 40] [--repeats 3]

One embedded cluster (one vLLM worker pinned to one core, bench/README.md rule 5) and a
``plexrl tinker`` gateway process in front of it. This process drives two LoRA jobs of the same
shape on ``tiny-arith-chat``: one through plexrl's client (``job.generate``, ``job.forward_backward``,
``job.optim_step``), one through the unmodified ``tinker`` SDK (``sample``, ``forward_backward``,
``optim_step``; its blocking calls in a thread, as a Tinker program makes them). Both do the same
work: the same prompt and greedy sampling (mean sampled tokens printed per mode), the same batch
of 8 chat-task sequences with the loss on every target token, the same Adam settings. Blocks of
``--calls`` calls alternate between the two paths per call kind so drift hits both alike.

Per call kind: p50 latency of each path and ``added`` = p50(gateway) - p50(plexrl), the mean over
repetitions with the spread (each repetition a fresh cluster and gateway). The floor beside it:
the p50 of an SDK call that does no plexrl work (``get_server_capabilities``, one HTTP round trip),
against which the SDK's two requests per call (submit, then a long-polled ``retrieve_future``)
are measured. The last line: ``tinker_gateway_added_ms_p50=<the largest kind's mean added>``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tinker

import plexrl
from plexrl.models import TINY_CHAT_MODEL, CharTokenizer
from plexrl.tasks import get_task
from plexrl.types import AdamW, Batch, LoRA, Ragged, SamplingParams

KINDS = ("sample", "forward_backward", "optim_step")
RANK = 8
ADAM = AdamW(lr=1e-5, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, grad_clip=None)
MAX_TOKENS = 8


def sequences() -> tuple[list[int], list[list[int]]]:
    """A chat-task prompt to sample from, and 8 prompt + reference sequences to train on."""
    tok = CharTokenizer()
    problems = get_task("chat").sample(8, np.random.default_rng(0))
    return tok.encode(problems[0].prompt), [tok.encode(p.prompt + p.answer) for p in problems]


def sdk_datums(rows: list[list[int]]) -> list[tinker.Datum]:
    return [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": np.array(r[1:], np.int64), "weights": np.ones(len(r) - 1, np.float32)},
        )
        for r in rows
    ]


def plexrl_batch(rows: list[list[int]]) -> Batch:
    """What the gateway makes of ``sdk_datums(rows)``: the loss on every target token."""
    return Batch(tokens=Ragged.from_rows(rows, "int32"), prompt_lens_B=np.ones(len(rows), np.int32),
                 token_weights=Ragged.from_rows([np.ones(len(r) - 1, np.float32) for r in rows], "float32"))  # fmt: skip


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


async def atimed(make: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await make()
    return time.perf_counter() - t0, out


class SdkProgram:
    """The Tinker side, every method blocking (run in a thread)."""

    def __init__(self, url: str) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.rest = tinker.RestClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model=TINY_CHAT_MODEL, rank=RANK).result()
        self.sampler = self.training.save_weights_and_get_sampling_client("bench").result()

    def call(self, kind: str, prompt: list[int], datums: list[tinker.Datum]) -> tuple[float, int]:
        if kind == "sample":
            params = tinker.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            s, out = timed(lambda: self.sampler.sample(tinker.ModelInput.from_ints(prompt), 1, params).result())
            return s, len(out.sequences[0].tokens)
        if kind == "forward_backward":
            return timed(lambda: self.training.forward_backward(datums, "cross_entropy").result())[0], 0
        adam = tinker.AdamParams(learning_rate=ADAM.lr, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0)
        self.training.forward_backward(datums, "cross_entropy").result()  # a step needs gradients; not timed
        return timed(lambda: self.training.optim_step(adam).result())[0], 0

    def floor(self) -> float:
        return timed(lambda: self.rest.get_server_capabilities().result())[0]

    def close(self) -> None:
        self.service.close("success").result()


async def repetition(calls: int, rep: int) -> dict[str, dict[str, list[float]]]:
    """One fresh cluster and gateway: latencies per path and kind (plus the floor, and tokens)."""
    prompt, rows = sequences()
    datums, batch = sdk_datums(rows), plexrl_batch(rows)
    out: dict[str, dict[str, list[float]]] = {"plexrl": {k: [] for k in KINDS}, "gateway": {k: [] for k in KINDS}}
    out["floor"] = {"get_server_capabilities": []}
    out["tokens"] = {"plexrl": [], "gateway": []}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = plexrl.local(workers=1, sampler="vllm", policy="plex", cpus_per_worker=1)
    async with cluster as client, plexrl.job("bench", TINY_CHAT_MODEL, lora=LoRA(rank=RANK), optimizer=ADAM) as job:
        gateway = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plexrl", "tinker", "--coordinator", client.address, "--bind", f"127.0.0.1:{port}",
            env={**os.environ, **cluster.client_env()}, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert gateway.stderr is not None
        try:
            async with asyncio.timeout(120):
                while b"Tinker gateway on" not in (line := await gateway.stderr.readline()):
                    if not line:
                        raise RuntimeError("the gateway exited before it served")
            sdk = await asyncio.to_thread(SdkProgram, f"http://127.0.0.1:{port}")
            await job.sync_weights()
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)

            async def plexrl_call(kind: str) -> tuple[float, int]:
                if kind == "sample":
                    s, gen = await atimed(lambda: job.generate([prompt], params))
                    return s, len(gen.samples[0].tokens)
                if kind == "forward_backward":
                    return (await atimed(lambda: job.forward_backward(batch, "cross_entropy")))[0], 0
                await job.forward_backward(batch, "cross_entropy")  # a step needs gradients; not timed
                return (await atimed(lambda: job.optim_step(ADAM, "sum")))[0], 0

            for warm in (True, False):
                for _ in range(1 if warm else 3):  # three blocks per path and kind, alternating
                    for kind in KINDS:
                        n_calls = 3 if warm else calls // 3
                        for path in ("plexrl", "gateway"):
                            for _ in range(n_calls):
                                if path == "plexrl":
                                    s, n = await plexrl_call(kind)
                                else:
                                    s, n = await asyncio.to_thread(sdk.call, kind, prompt, datums)
                                if not warm:
                                    out[path][kind].append(s)
                                    out["tokens"][path] += [n] if kind == "sample" else []
                        if not warm:
                            for _ in range(n_calls):
                                out["floor"]["get_server_capabilities"].append(await asyncio.to_thread(sdk.floor))
            await asyncio.to_thread(sdk.close)
        finally:
            gateway.terminate()
            await gateway.wait()
    print(f"repetition {rep}: " + "  ".join(
        f"{k} {np.median(out['plexrl'][k]) * 1e3:.1f} / {np.median(out['gateway'][k]) * 1e3:.1f} ms" for k in KINDS
    ), flush=True)  # fmt: skip
    return out


def spread(xs: list[float]) -> str:
    return f"{np.mean(xs):8.2f} [{min(xs):.2f}-{max(xs):.2f}]"


async def main(calls: int, repeats: int) -> None:
    reps = [await repetition(calls, r) for r in range(repeats)]
    print(
        f"\np50 latency per call, ms: mean over {repeats} repetitions [min-max]; {calls} calls per path and kind each"
    )
    print(f"{'call':18} {'plexrl client':>22} {'Tinker SDK + gateway':>22} {'added by the gateway':>22}")
    added: dict[str, list[float]] = {}
    for kind in KINDS:
        p = [float(np.median(r["plexrl"][kind])) * 1e3 for r in reps]
        g = [float(np.median(r["gateway"][kind])) * 1e3 for r in reps]
        added[kind] = [b - a for a, b in zip(p, g, strict=True)]
        print(f"{kind:18} {spread(p):>22} {spread(g):>22} {spread(added[kind]):>22}")
    floor = [float(np.median(r["floor"]["get_server_capabilities"])) * 1e3 for r in reps]
    print(f"{'floor: one HTTP round trip (get_server_capabilities)':52} {spread(floor)}")
    tokens = {mode: float(np.mean([t for r in reps for t in r["tokens"][mode]])) for mode in ("plexrl", "gateway")}
    print(f"same work: sampled tokens per sample, plexrl {tokens['plexrl']:.2f}, gateway {tokens['gateway']:.2f}")
    worst = max(added, key=lambda k: float(np.mean(added[k])))
    print(
        f"(an SDK call is a submit and a long-polled retrieve_future: two round trips at least, ~{2 * np.mean(floor):.1f} ms)"
    )
    print(
        f"tinker_gateway_added_ms_p50={np.mean(added[worst]):.2f} (worst kind: {worst}; worst repetition {max(added[worst]):.2f})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60, help="calls per path and kind in each repetition")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.repeats))
