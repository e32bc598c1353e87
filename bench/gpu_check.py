"""One prepared check for a machine with one NVIDIA GPU: no network, no downloads, <= 8 minutes.

    PYTHONUNBUFFERED=1 python bench/gpu_check.py [--layers 20] [--out bench-out/gpu]

Builds its own model from a config (a Qwen2 of about 1B parameters with random bf16 weights),
then measures and prints one table:

- pinned and pageable host <-> device copy bandwidth (GB/s), 1 GiB each way;
- residency: a LoRA job's and a full fine-tune job's state (weights, gradients, AdamW moments,
  sampler copy) moved to the host store and back by the worker's ``Mover`` (pinned buffers, a
  side stream), seconds and GB/s each way, checked bit-identical after the round trip;
- with vLLM installed: engine start, multi-LoRA generation tokens/s with 1, 8 and 32 adapters
  (each a different job's rank-16 adapter, all requests in flight together), sleep and wake
  time per level (1 and 2; partial wake ``weights`` then ``kv_cache``), and the refit time of a
  full-weight update through vLLM's in-place reload;
- without vLLM (the device image of this project's lender has none, and its wheel is larger
  than what can be carried there): the same multi-LoRA generation with transformers + peft
  mixed-adapter batches, and the refit as a state-dict copy, so the table is never empty.

Also runs on CPU with ``--device cpu --layers 2 --hidden 256`` as a dry run of every code path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROWS: list[tuple[str, str, str]] = []  # (what, value, unit)


def row(what: str, value: float | str, unit: str = "") -> None:
    text = f"{value:.3f}" if isinstance(value, float) else value
    ROWS.append((what, text, unit))
    print(f"  {what:48} {text:>12} {unit}", flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def build_model(out: Path, layers: int, hidden: int, device: str) -> tuple[Path, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = hidden // 128 if hidden >= 1024 else hidden // 32  # head size 128 (32 for dry runs)
    config = Qwen2Config(
        vocab_size=32768,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def copy_bandwidth(device: str, gib: float) -> None:
    if not device.startswith("cuda"):
        row("host<->device copies", "skipped (no GPU)")
        return
    n = int(gib * (1 << 30))
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    for pinned in (True, False):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        kind = "pinned" if pinned else "pageable"
        copies: dict[str, Callable[[], Any]] = {
            "H2D": lambda host=host: dev.copy_(host, non_blocking=True),
            "D2H": lambda host=host: host.copy_(dev, non_blocking=True),
        }
        for direction, fn in copies.items():
            fn()
            seconds = min(timed(fn)[0] for _ in range(5))
            row(f"{kind} {direction} copy, {gib:g} GiB", n / seconds / 1e9, "GB/s")


def residency(model_dir: Path, device: str) -> None:
    """The worker's state transitions on this device, timed, on real jobs that have stepped."""
    from plexrl.protocol.calls import Close, ForwardBackward, JobSpec, Open, OptimStep
    from plexrl.types import AdamW, Batch, LoRA, Ragged
    from plexrl.worker.engine import Engine
    from plexrl.worker.memory import state_refs

    engine = Engine(device=device, sampler="hf")
    try:
        rows = Ragged.from_rows([list(range(3, 3 + 64))] * 4, "int32")
        batch = Batch(tokens=rows, prompt_lens_B=np.full(4, 8, np.int32))
        for job, lora in (("lora", LoRA(rank=16)), ("full", None)):
            engine.execute(job, Open(JobSpec(model=str(model_dir), lora=lora, optimizer=AdamW(lr=1e-4))))
            engine.execute(job, ForwardBackward(batch=batch, loss="cross_entropy"))
            engine.execute(job, OptimStep())
            engine.execute(job, ForwardBackward(batch=batch, loss="cross_entropy"))  # gradients pending too
            before = {
                k: r.get().detach().clone() for k, r in state_refs(engine._jobs[job]).items() if r.get() is not None
            }
            for _ in range(2):  # the second round is the one reported (allocator warm)
                out, back = engine.move(job, "host"), engine.move(job, "device")
            after = {k: r.get() for k, r in state_refs(engine._jobs[job]).items() if r.get() is not None}
            same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            gb = out.bytes / 1e9
            row(f"{job} job state {gb:.2f} GB to host", out.seconds, f"s ({gb / out.seconds:.1f} GB/s)")
            row(f"{job} job state {gb:.2f} GB to device", back.seconds, f"s ({gb / back.seconds:.1f} GB/s)")
            row(f"{job} job state bit-identical after the round trip", str(same))
            del before, after
            engine.execute(job, Close())
    finally:
        engine.close()


def random_adapter(hidden_params: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (d_out, d_in) in hidden_params.items():
        out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.01
        out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    return out


def lora_targets(model_dir: Path) -> dict[str, tuple[int, int]]:
    """q_proj and v_proj of every layer: name -> (out, in) features."""
    import json

    c = json.loads((model_dir / "config.json").read_text())
    head = c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    out = {}
    for i in range(c["num_hidden_layers"]):
        out[f"model.layers.{i}.self_attn.q_proj"] = (c["hidden_size"], c["hidden_size"])
        out[f"model.layers.{i}.self_attn.v_proj"] = (kv, c["hidden_size"])
    return out


def with_vllm(model_dir: Path, device: str, prompts: list[list[int]], n: int, max_tokens: int) -> None:
    from peft import LoraConfig
    from safetensors.torch import load_file

    from plexrl.types import Ragged, SamplingParams
    from plexrl.worker.sampler.vllm import VllmConfig, VllmSampler

    config = VllmConfig(
        max_loras=32,
        max_lora_rank=16,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        gpu_memory_utilization=0.45,
    )
    seconds, sampler = timed(lambda: VllmSampler(str(model_dir), device, config))
    row("vllm engine start (LoRA engine)", seconds, "s")
    sampler.restore = lambda: {k: v.to(device) for k, v in load_file(next(model_dir.glob("*.safetensors"))).items()}
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    targets = lora_targets(model_dir)
    batch = Ragged.from_rows(prompts, "int32")
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
    try:
        seconds, _ = timed(lambda: sampler.set_adapter("job0", 0, random_adapter(targets, 16, 0), peft_config))
        row("publish one rank-16 adapter (in memory + add_lora)", seconds, "s")
        for j in range(1, 32):
            sampler.set_adapter(f"job{j}", 0, random_adapter(targets, 16, j), peft_config)
        for jobs in (1, 8, 32):

            def run(jobs: int = jobs) -> int:
                futs = [
                    sampler.submit(f"job{j}", batch, params, seed=j, stop_token_ids=(), weight_version=0)
                    for j in range(jobs)
                ]
                return sum(len(f.result(timeout=600).tokens.values) for f in futs)

            run(1)  # warm-up
            seconds, tokens = timed(run)
            row(f"vllm multi-LoRA generation, {jobs} adapters", tokens / seconds, "tokens/s")
        for level in (1, 2):
            seconds, _ = timed(lambda level=level: sampler.sleep(level))
            row(f"vllm sleep level {level}", seconds, "s")
            if sampler.sleep_mode:
                seconds, _ = timed(lambda: sampler.wake(["weights"]))
                row(f"vllm wake after level {level}: weights", seconds, "s")
                seconds, _ = timed(lambda: sampler.wake(["kv_cache"]))
                row(f"vllm wake after level {level}: kv_cache", seconds, "s")
            else:
                seconds, _ = timed(lambda: sampler.wake())
                row(f"vllm wake after level {level} (CPU: pause only)", seconds, "s")
            out = sampler.submit("job0", batch, params, seed=0, stop_token_ids=(), weight_version=0).result(600)
            row(f"  generation works after level-{level} wake", "yes" if len(out.tokens) == len(prompts) * n else "NO")
    finally:
        sampler.close()
    seconds, full = timed(lambda: VllmSampler(str(model_dir), device, config, lora=False))
    row("vllm engine start (full-weight engine)", seconds, "s")
    try:
        weights = {}
        for f in model_dir.glob("*.safetensors"):
            weights.update(load_file(f))
        weights = {k: v + 0.001 for k, v in weights.items()}
        seconds, _ = timed(lambda: full.refit(weights))
        size = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
        row(f"vllm refit, {size:.1f} GB in memory through in-place reload", seconds, "s")
    finally:
        full.close()


def without_vllm(model_dir: Path, device: str, prompts: list[list[int]], n: int, max_tokens: int) -> None:
    from peft import LoraConfig, get_peft_model
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    row("vllm", "not installed: transformers + peft instead")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, config, adapter_name="job0")
    targets = lora_targets(model_dir)
    for j in range(32):
        if j:
            model.add_adapter(f"job{j}", config)
        sd = {k: v.to(dtype) for k, v in random_adapter(targets, 16, j).items()}
        set_peft_model_state_dict(model, sd, adapter_name=f"job{j}")
    model.eval()
    for jobs in (1, 8, 32):
        rows = [p for _ in range(jobs) for p in prompts for _ in range(n)]  # peft wants a name per row
        names = [f"job{j}" for j in range(jobs) for _ in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
        mask = (
            torch.arange(width, device=device)[None]
            >= torch.tensor([width - len(r) for r in rows], device=device)[:, None]
        ).long()

        def run(
            ids: torch.Tensor = ids, mask: torch.Tensor = mask, names: list[str] = names, width: int = width
        ) -> int:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=True,
                    max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                )  # fmt: skip
            return int(out.shape[0] * (out.shape[1] - width))

        seconds, tokens = timed(run)
        row(f"hf+peft mixed-adapter generation, {jobs} adapters", tokens / seconds, "tokens/s")
    trainer = {k: v.clone() for k, v in base.state_dict().items()}
    seconds, _ = timed(lambda: base.load_state_dict(trainer, strict=False))
    size = sum(t.numel() * t.element_size() for t in trainer.values()) / 1e9
    row(f"refit as a state-dict copy, {size:.1f} GB (no vLLM)", seconds, "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per adapter")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--copy-gib", type=float, default=1.0)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu --layers 2 --hidden 256 for a dry run")
    t_start = time.perf_counter()
    print(
        f"plexrl gpu_check on {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'cpu'}", flush=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        seconds, (model_dir, params) = timed(
            lambda: build_model(Path(tmp) / "model", args.layers, args.hidden, args.device)
        )
        row(f"build + save a {params / 1e9:.2f}B-parameter model", seconds, "s")
        copy_bandwidth(args.device, args.copy_gib)
        residency(model_dir, args.device)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 32000, size=int(rng.integers(32, 128))).tolist() for _ in range(args.prompts)]
        from plexrl.worker.sampler import vllm

        if vllm.available():
            with_vllm(model_dir, args.device.split(":")[0], prompts, args.n, args.max_tokens)
        else:
            without_vllm(model_dir, args.device, prompts, args.n, args.max_tokens)
    print(f"\n{'measure':50} {'value':>12} unit   ({time.perf_counter() - t_start:.0f} s in all)")
    for what, value, unit in ROWS:
        print(f"{what:50} {value:>12} {unit}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
