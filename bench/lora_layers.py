"""vLLM's CPU multi-LoRA layer against plexrl's grouped one, on the shipped model's shapes.

    python bench/lora_layers.py [--repeats 5] [--calls 200]

One ``add_lora_linear`` of a merged q/k/v projection (hidden 128, LoRA rank 8, 32 adapter slots),
the same inputs for both: ``PunicaWrapperCPU`` (vLLM's torch ops: every token's adapter matrices
gathered, multiplied token by token) and ``GroupedPunicaWrapperCPU`` (``plexrl.worker.sampler
.cpu_lora``: tokens grouped by adapter once per step, then one matmul per group). Cases: decode
steps of 16 and 256 tokens spread over 32 adapters (a busy shared engine) or on 1 (one job), a
prefill of 2048 tokens over 4 adapters, and one adapter holding most of 300 tokens. The grouping is
made once per step and serves every layer, so it is timed apart (per step) from the layer (per
call). One thread; mean [min-max] over ``--repeats`` timings of ``--calls`` calls each. Also checks
that both add the same (max abs difference printed). Ends with ``grouped_speedup_min=`` (the
smallest layer speedup over the cases).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from plexrl.worker.sampler import cpu_lora

RANK, IN, SLOTS, SLICES = 8, 128, 32, (128, 64, 64)
CASES = {  # name: (tokens, adapters, prefill, piled)
    "decode 16 tokens, 32 adapters": (16, 32, False, False),
    "decode 256 tokens, 32 adapters": (256, 32, False, False),
    "decode 256 tokens, 1 adapter": (256, 1, False, False),
    "prefill 2048 tokens, 4 adapters": (2048, 4, True, False),
    "decode 300 tokens, one adapter holding most": (300, 32, False, True),
}


def wrapper(cls: type, indices: torch.Tensor, prefill: bool) -> PunicaWrapperCPU:
    w = cls(4096, 256, "cpu")
    w._token_lora_indices[: len(indices)] = indices
    w.indices_len[:] = [len(indices)] * 4
    w.is_prefill = prefill
    if prefill:
        w._update_prefill_metadata(w.token_lora_indices)
    return w


def timed(fn: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """Microseconds per call, one figure per repetition."""
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) for out in SLICES)
    print(f"one add_lora_linear of a q/k/v projection (in {IN}, rank {RANK}, {SLOTS} slots), one thread, "
          f"microseconds, mean [min-max] of {args.repeats} x {args.calls} calls")  # fmt: skip
    print(f"  {'case':46} | {'vLLM ops':>16} | {'grouped':>16} | {'speedup':>7} | {'grouping/step':>14} | max diff")
    speedups = []
    for name, (tokens, adapters, prefill, piled) in CASES.items():
        if piled:
            indices = torch.cat([torch.zeros(tokens - adapters + 1, dtype=torch.long), torch.arange(1, adapters)])
        else:
            indices = torch.randint(0, adapters, (tokens,), generator=g)
        if prefill:
            indices = torch.sort(indices).values  # a prefill's tokens come sequence by sequence
        x = torch.randn(tokens, IN, generator=g)
        y_vllm, y_grouped = torch.zeros(tokens, sum(SLICES)), torch.zeros(tokens, sum(SLICES))
        ref = wrapper(PunicaWrapperCPU, indices, prefill)
        grouped = wrapper(cpu_lora.GroupedPunicaWrapperCPU, indices, prefill)
        ref.add_lora_linear(y_vllm, x, lora_a, lora_b, 1.0, SLICES)
        grouped.add_lora_linear(y_grouped, x, lora_a, lora_b, 1.0, SLICES)  # makes the step's groups
        diff = float((y_vllm - y_grouped).abs().max())
        layer = (x, lora_a, lora_b, 1.0, SLICES)
        t_ref = timed(functools.partial(ref.add_lora_linear, y_vllm, *layer), args.calls, args.repeats)
        t_grp = timed(functools.partial(grouped.add_lora_linear, y_grouped, *layer), args.calls, args.repeats)
        t_groups = timed(functools.partial(cpu_lora.TokenGroups.of, indices, SLOTS), args.calls, args.repeats)
        speedup = statistics.mean(t_ref) / statistics.mean(t_grp)
        speedups.append(speedup)
        print(f"  {name:46} | {spread(t_ref):>16} | {spread(t_grp):>16} | {speedup:>6.2f}x | {spread(t_groups):>14} "
              f"| {diff:.1e}")  # fmt: skip
    print(
        "  limit: one layer call, not a model step (a step makes 4 per layer: q/k/v, o, gate/up, down; 4 layers; one grouping)"
    )
    print(f"grouped_speedup_min={min(speedups):.2f}")


if __name__ == "__main__":
    main()
