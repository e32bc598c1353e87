"""The trainer's memory per trained token, bounded or not, and the device plan for real models.

    python bench/memory.py [--tokens 1024,4096,16384] [--repeats 3] [--microbatch 4096]

On the model shaped like Qwen3-1.7B (``plexrl.models.QWEN3_SHAPED_CONFIG``: its 151,936-token
vocabulary, head size 128, tied embeddings, 2 small layers; random bf16 weights), one LoRA job
(rank 8 on every linear layer) runs one GRPO ``forward_backward`` on a batch vLLM-CPU sampled in
bf16: 8 rows of a 64-token prompt and a completion of exactly ``T / 8 - 64`` tokens
(``min_tokens = max_tokens``), for T in ``--tokens`` tokens per call. The same batch in three
trainer modes:

- ``fp32 unbounded``: the path before this bench existed: float32 weights, no checkpointing,
  logits at every position at once, the call's rows in one piece (one backward);
- ``bf16 bounded``: bf16 base weights under autocast (float32 LoRA masters), checkpointed layers,
  logits only at completion positions in checkpointed chunks of 2^25 elements, micro-batches of
  at most ``--microbatch`` tokens with a backward each (what a worker runs by default, at a
  smaller micro-batch);
- ``fp32 bounded``: the same bounded path in float32 (the bf16 against fp32 speed comparison).

Each repetition of each mode runs in a fresh process (the modes alternate within a repetition):
it loads the model, runs one warm-up ``forward_backward`` on a 2-row slice, then resets the
process's peak RSS (``/proc/self/clear_refs``) and runs the measured call. Peak = the process's
peak resident set (VmHWM) during the call less its resident set before it: **process RSS**, not
torch's allocator statistics (CPU torch keeps none); glibc is told to map every allocation of
64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the RSS at once and
the warm-up's memory is not silently reused. Time = the measured call's wall seconds on both
cores. The fp32 unbounded path at 16k tokens holds four times its 4k peak (three float32
``[T, 151936]`` tensors), more than this machine's RAM: it is not run there, and the table says so.

The limit beside the reduction: the fp32 peak per trained token over the least a bounded path
must hold (one chunk's float32 logits and each checkpointed layer's bf16 input), i.e. the
reduction if the chunk's other copies, the recomputed layer and the LoRA inputs cost nothing.

The plan's table: Qwen3-1.7B and Qwen3-8B (their published config.json shapes) on an 80 GB H100
in bf16 with the vLLM sampler at the worker's defaults (``--gpu-memory-utilization 0.3``,
``--max-tokens-per-microbatch 8192``, ``--max-model-len 8192``, ``--max-loras 32``), from the
same ``plexrl.plan`` the scheduler places by: LoRA rank-8 jobs resident at once, the largest
micro-batch beside the base and one job, and whether a full fine-tune fits. Beside the measured
peaks, the plan's activation headroom for the same model and micro-batch on this CPU.

Last lines: ``peak_bytes_per_token_reduction=`` (fp32 unbounded / bf16 bounded, per trained
token at 4k tokens; target >= 5), ``peak_flat_4k_to_16k=`` (bf16 bounded peak at 16k over 4k;
target <= 1.2) and ``h100_qwen3_8b_lora_jobs=``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import numpy as np

MODES = {
    "fp32 unbounded": {"dtype": "float32", "checkpointing": False, "chunk_elements": None, "microbatch": None},
    "bf16 bounded": {"dtype": "bfloat16", "checkpointing": True, "chunk_elements": 1 << 25, "microbatch": "arg"},
    "fp32 bounded": {"dtype": "float32", "checkpointing": True, "chunk_elements": 1 << 25, "microbatch": "arg"},
}
PROMPT, ROWS = 64, 8
MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,16384", help="tokens per call (prompt + completion, all rows)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--microbatch", type=int, default=4096, help="the bounded modes' max tokens per micro-batch")
    p.add_argument("--out", default="bench-out/memory")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one measurement in this process
    p.add_argument("--batch", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model, args.batch, MODES[args.measure], args.microbatch)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model(out / "qwen3-shaped")
    sizes = [int(t) for t in args.tokens.split(",")]
    batches = sample_batches(model, sizes, out)
    rows = run_modes(model, batches, sizes, args.repeats, args.microbatch)
    (out / "memory.json").write_text(json.dumps(rows, indent=1))
    report(rows, sizes, model, args.microbatch)


# -- the batches: vLLM-CPU samples them in bf16 ---------------------------------------------------


def write_model(path: Path) -> Path:
    from plexrl.models import QWEN3_SHAPED_CONFIG, write_random_model

    if not (path / "config.json").is_file():
        write_random_model(path, seed=0, shape=QWEN3_SHAPED_CONFIG, dtype="bfloat16")
    return path


def sample_batches(model: Path, sizes: list[int], out: Path) -> dict[int, Path]:
    """One GRPO batch per size, sampled by vLLM-CPU in bf16 (exact lengths), saved as .npz."""
    from plexrl.protocol.calls import Generate, Generated, JobSpec, Open
    from plexrl.types import LoRA, Ragged, SamplingParams
    from plexrl.worker.engine import Engine
    from plexrl.worker.sampler.vllm import VllmConfig
    from plexrl.worker.trainer.forward import TrainerSettings

    paths = {t: out / f"batch-{t}.npz" for t in sizes}
    if all(p.is_file() for p in paths.values()):
        return paths
    rng = np.random.default_rng(0)
    config = VllmConfig(max_model_len=max(sizes) // ROWS + 64, max_loras=1)
    engine = Engine(sampler="vllm", vllm_config=config, trainer=TrainerSettings(dtype="bfloat16"))
    try:
        engine.execute("sampler", Open(JobSpec(model=str(model), lora=LoRA(rank=8))))
        for t, path in paths.items():
            length = t // ROWS - PROMPT
            prompts = [rng.integers(0, 151643, PROMPT).tolist() for _ in range(ROWS)]
            params = SamplingParams(max_tokens=length, min_tokens=length, temperature=1.0, seed=t)
            print(f"sampling {ROWS} x {length} tokens with vLLM-CPU (bf16) ...", flush=True)
            start = time.perf_counter()
            gen = engine.execute("sampler", Generate(Ragged.from_rows(prompts, "int32"), params))
            assert isinstance(gen, Generated) and set(gen.tokens.lengths().tolist()) == {length}
            print(f"  {time.perf_counter() - start:.0f} s", flush=True)
            full = [np.concatenate([prompts[i], gen.tokens[i]]) for i in range(ROWS)]
            np.savez(
                path,
                tokens=np.concatenate(full).astype(np.int32),
                lengths=np.array([len(f) for f in full]),
                logprobs=gen.logprobs.values,
            )
    finally:
        engine.close()
    return paths


# -- one measurement, in a fresh process -----------------------------------------------------------


def run_modes(
    model: Path, batches: dict[int, Path], sizes: list[int], repeats: int, microbatch: int
) -> list[dict[str, object]]:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    rows: list[dict[str, object]] = []
    for rep in range(repeats):
        for t in sizes:
            for mode in MODES:
                fp32_4k = [r for r in rows if r["mode"] == "fp32 unbounded" and r["tokens"] < t]
                if mode == "fp32 unbounded" and fp32_4k:
                    need = max(int(r["peak_bytes"]) for r in fp32_4k) * t / max(int(r["tokens"]) for r in fp32_4k)
                    if need > 0.8 * ram:
                        rows.append(
                            {"mode": mode, "tokens": t, "rep": rep, "skipped": f"needs ~{need / 2**30:.0f} GiB"}
                        )
                        continue
                cmd = [sys.executable, __file__, "--measure", mode, "--model", str(model), "--batch", str(batches[t])]
                cmd += ["--microbatch", str(microbatch)]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{mode} at {t} tokens failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append({"mode": mode, "tokens": t, "rep": rep, **result})
                print(
                    f"rep {rep} {t:>6} tokens {mode:<15} peak {result['peak_bytes'] / MiB:8.0f} MiB "
                    f"{result['seconds']:6.2f} s",
                    flush=True,
                )
    return rows


def measure(model: str, batch_path: str, mode: dict[str, object], microbatch: int) -> dict[str, float]:
    from plexrl.protocol.calls import ForwardBackward, ForwardBackwardResult, JobSpec, Open
    from plexrl.types import Batch, LoRA, Ragged
    from plexrl.worker.engine import Engine
    from plexrl.worker.trainer.forward import TrainerSettings

    data = np.load(batch_path)
    lengths = data["lengths"]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    completion = lengths - PROMPT
    batch = Batch(
        tokens=Ragged(values=data["tokens"], offsets=offsets),
        prompt_lens_B=np.full(len(lengths), PROMPT, np.int32),
        sampler_logprobs=Ragged(values=data["logprobs"], offsets=np.concatenate([[0], np.cumsum(completion)])),
        advantages_B=np.linspace(-1.0, 1.0, len(lengths)).astype(np.float32),
        weight_versions_B=np.zeros(len(lengths), np.int64),
    )
    settings = TrainerSettings(
        dtype=str(mode["dtype"]),
        max_tokens_per_microbatch=microbatch if mode["microbatch"] == "arg" else None,
        chunk_elements=mode["chunk_elements"],  # type: ignore[arg-type]
    )
    engine = Engine(trainer=settings)
    spec = JobSpec(model=model, lora=LoRA(rank=8), gradient_checkpointing=bool(mode["checkpointing"]))
    engine.execute("j", Open(spec))
    warm = Batch(
        tokens=Ragged.from_rows([batch.tokens[0][: PROMPT + 8], batch.tokens[1][: PROMPT + 8]], "int32"),
        prompt_lens_B=batch.prompt_lens_B[:2],
        sampler_logprobs=Ragged.from_rows([batch.sampler_logprobs[0][:8], batch.sampler_logprobs[1][:8]], "float32"),  # type: ignore[index]
        advantages_B=batch.advantages_B[:2],  # type: ignore[index]
        weight_versions_B=batch.weight_versions_B[:2],  # type: ignore[index]
    )
    engine.execute("j", ForwardBackward(warm, loss="grpo"))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM)
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    result = engine.execute("j", ForwardBackward(batch, loss="grpo"))
    seconds = time.perf_counter() - start
    assert isinstance(result, ForwardBackwardResult)
    peak = (_status_kib("VmHWM") - before) * 1024
    return {"peak_bytes": peak, "seconds": seconds, "trained_tokens": int(completion.sum())}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# -- the report --------------------------------------------------------------------------------------


def report(rows: list[dict[str, object]], sizes: list[int], model: Path, microbatch: int) -> None:
    from plexrl.plan import ModelShape, WorkerPlan, activation_bytes

    def runs(mode: str, t: int) -> list[dict[str, object]]:
        return [r for r in rows if r["mode"] == mode and r["tokens"] == t and "peak_bytes" in r]

    print(f"\nPeak process RSS of one forward_backward, Qwen3-shaped model, LoRA r8, micro-batch {microbatch} tokens")
    print("(mean [min-max] of the repetitions; per trained token = peak / completion tokens)\n")
    print("| tokens/call | mode | peak MiB | KiB per trained token | seconds | trained tokens/s |")
    print("|---|---|---|---|---|---|")
    for t in sizes:
        for mode in MODES:
            got = runs(mode, t)
            if not got:
                why = next((r["skipped"] for r in rows if r["mode"] == mode and r["tokens"] == t), "not run")
                print(f"| {t} | {mode} | not run: {why}, more than this machine's RAM | | | |")
                continue
            peak = [float(r["peak_bytes"]) for r in got]  # type: ignore[arg-type]
            per = [p / float(r["trained_tokens"]) for p, r in zip(peak, got, strict=True)]  # type: ignore[arg-type]
            secs = [float(r["seconds"]) for r in got]  # type: ignore[arg-type]
            rate = [float(r["trained_tokens"]) / s for r, s in zip(got, secs, strict=True)]  # type: ignore[arg-type]
            print(
                f"| {t} | {mode} | {_spread([p / MiB for p in peak], '.0f')} | {_spread([x / 1024 for x in per], '.1f')} "
                f"| {_spread(secs, '.2f')} | {_spread(rate, '.0f')} |"
            )
    shape = ModelShape.read(model)
    assert shape is not None
    cpu = WorkerPlan(capacity_bytes=1, dtype="bfloat16", max_tokens_per_microbatch=microbatch)
    print(
        f"\nThe plan's activation headroom for this model at {microbatch} tokens in bf16, checkpointed: "
        f"{activation_bytes(cpu, shape, True) / MiB:.0f} MiB (the bf16 bounded peaks above are what it must cover)"
    )

    def per_token(mode: str, t: int) -> list[float]:
        return [float(r["peak_bytes"]) / float(r["trained_tokens"]) for r in runs(mode, t)]  # type: ignore[arg-type]

    t4 = 4096 if 4096 in sizes else sizes[len(sizes) // 2]
    old, new = per_token("fp32 unbounded", t4), per_token("bf16 bounded", t4)
    reductions = [o / n for o, n in zip(old, new, strict=True)]
    # The least a bounded path can hold: one chunk's float32 logits and each layer's bf16 input.
    trained = float(runs("bf16 bounded", t4)[0]["trained_tokens"])  # type: ignore[arg-type]
    floor = ((1 << 25) * 4 + t4 * shape.layers * shape.hidden * 2) / trained
    print(
        f"\nAt {t4} tokens: fp32 unbounded / bf16 bounded peak per trained token = {_spread(reductions, '.1f')} "
        f"(limit {mean(old) / floor:.0f}: a bounded path holding only one chunk's float32 logits and each "
        "layer's bf16 input)"
    )
    speed = [b / f for b, f in zip(_rates(runs("bf16 bounded", t4)), _rates(runs("fp32 bounded", t4)), strict=True)]
    print(f"Trainer tokens/s, bf16 bounded over fp32 bounded at {t4} tokens: {_spread(speed, '.2f')}")
    flat = None
    if max(sizes) > t4:
        peaks_hi = [float(r["peak_bytes"]) for r in runs("bf16 bounded", max(sizes))]  # type: ignore[arg-type]
        peaks_4k = [float(r["peak_bytes"]) for r in runs("bf16 bounded", t4)]  # type: ignore[arg-type]
        flat = [h / f for h, f in zip(peaks_hi, peaks_4k, strict=True)]
        print(f"bf16 bounded peak at {max(sizes)} tokens over {t4}: {_spread(flat, '.2f')} (set by the micro-batch)")

    jobs_8b = plan_table()
    print(f"\npeak_bytes_per_token_reduction={min(reductions):.2f} (worst repetition; mean {mean(reductions):.2f})")
    if flat is not None:
        print(f"peak_flat_4k_to_16k={max(flat):.2f} (worst repetition)")
    print(f"h100_qwen3_8b_lora_jobs={jobs_8b}")


def plan_table() -> int:
    """The plan for Qwen3-1.7B / 8B on an 80 GB H100 at the worker's defaults; returns 8B's LoRA jobs."""
    import msgspec

    from plexrl.models import QWEN3_CONFIGS
    from plexrl.plan import (
        GiB,
        JobShape,
        ModelShape,
        WorkerPlan,
        footprint,
        free_bytes,
        held_bytes,
        lora_jobs_per_device,
        refusal,
    )

    # What torch reports of an H100 80 GB is about 79 GiB; 78 GiB leaves room for what the driver keeps.
    h100 = WorkerPlan(capacity_bytes=78 * GiB, device_type="cuda", dtype="bfloat16", sampler="vllm")
    print(
        "\nThe device plan (plexrl.plan, as the scheduler places): H100 80 GB taken as 78 GiB, bf16, vLLM at "
        f"--gpu-memory-utilization {h100.gpu_memory_utilization}, --max-tokens-per-microbatch "
        f"{h100.max_tokens_per_microbatch}, --engine-sleep {h100.engine_sleep} (the engines sleep while training "
        "needs their memory: the engines or the activations are counted, whichever is larger), LoRA rank 8 on every "
        "linear layer\n"
    )
    print("| model | params | base weights | shared engine | activations | per LoRA job | LoRA jobs per GPU "
          "| largest micro-batch (base + 1 job) | full fine-tune |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    jobs = {}
    for name, config in QWEN3_CONFIGS.items():
        shape = ModelShape.of(config)
        lora = JobShape(shape, lora_rank=8)
        fp = footprint(h100, lora)
        jobs[name] = lora_jobs_per_device(h100, lora)
        largest = 0
        for tokens in (1 << k for k in range(8, 20)):
            plan = msgspec.structs.replace(h100, max_tokens_per_microbatch=tokens)
            f = footprint(plan, lora)
            if f.base + f.state <= free_bytes(plan):
                largest = tokens
        full = JobShape(shape)
        ffp = footprint(h100, full)
        why = refusal(h100, full, ffp)
        need = ffp.state + held_bytes(h100, ffp.parts["base weights"], ffp.parts["activations"], ffp.pinned)
        print(
            f"| Qwen3-{name} | {shape.params / 1e9:.2f}B | {fp.parts['base weights'] / GiB:.1f} GiB "
            f"| {fp.parts['shared engine'] / GiB:.1f} GiB | {fp.parts['activations'] / GiB:.1f} GiB "
            f"| {fp.state / GiB:.2f} GiB | {jobs[name]} | {largest} | "
            f"{'fits' if why is None else 'does not fit'} ({need / GiB:.0f} GiB with its engine) |"
        )
    return jobs["8B"]


def _rates(got: list[dict[str, object]]) -> list[float]:
    return [float(r["trained_tokens"]) / float(r["seconds"]) for r in got]  # type: ignore[arg-type]


def _spread(values: list[float], fmt: str) -> str:
    return f"{mean(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


if __name__ == "__main__":
    main()
