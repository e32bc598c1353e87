"""The in-process engine on the tiny random model: LoRA and full fine-tune jobs side by side."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from plexrl.errors import (
    BatchShapeError,
    CallFailedError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    StaleSamplesError,
    UnknownJobError,
)
from plexrl.protocol.calls import (
    Call,
    Close,
    ForwardBackward,
    ForwardBackwardResult,
    Generate,
    Generated,
    JobSpec,
    Load,
    Loaded,
    Logprobs,
    LogprobsResult,
    Open,
    Opened,
    OptimStep,
    OptimStepResult,
    Restore,
    Save,
    Saved,
    Synced,
    SyncWeights,
)
from plexrl.types import AdamW, Batch, LoRA, LossConfig, Ragged, Sample, SamplingParams
from plexrl.worker.engine import Engine
from plexrl.worker.trainer import checkpoint
from plexrl.worker.trainer import job as trainer_job
from plexrl.worker.trainer.forward import TrainerSettings, microbatches

PROMPTS = [[1, 5, 6, 7], [1, 9]]
STOPS = (5, 6, 7, 8, 9, 10, 11, 12)  # many stop tokens, so rows both stop and run to length
FAST = AdamW(lr=1e-2)
SNAPSHOTS = 1 << 30  # Open(snapshot_max_bytes=): every job here takes snapshots
R = TypeVar("R")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def engine() -> Engine:
    return Engine()


def lora_spec(model: Path, seed: int = 0, rank: int = 4) -> JobSpec:
    return JobSpec(model=str(model), lora=LoRA(rank=rank), optimizer=FAST, seed=seed)


def full_spec(model: Path, seed: int = 0) -> JobSpec:
    return JobSpec(model=str(model), lora=None, optimizer=FAST, seed=seed)


def ce_batch(rows: list[list[int]] | None = None) -> Batch:
    rows = rows or [[1, 5, 6, 7, 8, 9], [1, 9, 10, 11, 12], [1, 3, 3, 3]]
    return Batch(tokens=Ragged.from_rows(rows, "int32"), prompt_lens_B=np.full(len(rows), 2, np.int32))


def train(engine: Engine, job: str, steps: int = 2, sync: bool = True) -> None:
    for _ in range(steps):
        engine.execute(job, ForwardBackward(ce_batch(), loss="cross_entropy"))
        engine.execute(job, OptimStep())
    if sync:
        engine.execute(job, SyncWeights())


def run(engine: Engine, job: str, call: Call, result_type: type[R]) -> R:
    """Execute ``call`` and check that it returned a ``result_type``."""
    result = engine.execute(job, call)
    assert isinstance(result, result_type)
    return result


def generate(engine: Engine, job: str, **params: Any) -> Generated:
    return run(engine, job, Generate(Ragged.from_rows(PROMPTS, "int32"), SamplingParams(**params)), Generated)


def rows(r: Ragged) -> list[list[float]]:
    return [row.tolist() for row in r]


def trainer_logprobs(engine: Engine, job: str, out: Generated) -> list[np.ndarray]:
    """The trainer's logprobs of each generated completion, via a Logprobs call."""
    full = [np.concatenate([PROMPTS[p], t]) for p, t in zip(out.prompt_index_B, out.tokens, strict=True)]
    result = run(engine, job, Logprobs(Ragged.from_rows(full, "int32")), LogprobsResult)
    return [lp[len(PROMPTS[p]) - 1 :] for p, lp in zip(out.prompt_index_B, result.logprobs, strict=True)]


def saved_weights(engine: Engine, job: str, path: Path) -> dict[str, np.ndarray]:
    engine.execute(job, Save(str(path)))
    return {k: v.numpy() for k, v in load_file(str(path / checkpoint.WEIGHTS)).items()}


def assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=atol, err_msg=k)


# -- open / close -------------------------------------------------------------------------------


def test_open_reports_version_zero_and_parameter_counts(engine: Engine, tiny_model: Path) -> None:
    lora = run(engine, "a", Open(lora_spec(tiny_model)), Opened)
    full = run(engine, "f", Open(full_spec(tiny_model)), Opened)
    assert lora.weight_version == 0 and full.weight_version == 0
    assert 0 < lora.trainable_params < full.trainable_params == full.total_params
    assert lora.total_params == full.total_params + lora.trainable_params
    assert engine.job_ids() == ["a", "f"]


def test_opening_an_open_job_id_is_rejected(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    with pytest.raises(InvalidRequestError, match="already open"):
        engine.execute("a", Open(full_spec(tiny_model)))


@pytest.mark.parametrize("where", ["missing", "empty_dir"])
def test_a_missing_model_names_its_path(engine: Engine, tmp_path: Path, where: str) -> None:
    path = tmp_path / "nope" if where == "missing" else tmp_path
    with pytest.raises(ModelNotFoundError, match=str(path)):
        engine.execute("a", Open(JobSpec(model=str(path))))
    assert engine.job_ids() == []


@pytest.mark.parametrize(
    "spec_change, match",
    [
        ({"lora": LoRA(target_modules=("not_a_layer",))}, "target_modules"),
        ({"lora": LoRA(rank=0)}, "rank"),
        ({"optimizer": AdamW(lr=-1.0)}, "lr"),
        ({"optimizer": AdamW(grad_clip=0.0)}, "grad_clip"),
    ],
)
def test_open_rejects_bad_specs(engine: Engine, tiny_model: Path, spec_change: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.execute("a", Open(JobSpec(model=str(tiny_model), **spec_change)))
    assert engine.job_ids() == []


def test_calls_on_unknown_or_closed_jobs_raise_unknown_job(engine: Engine, tiny_model: Path) -> None:
    with pytest.raises(UnknownJobError, match="'ghost'"):
        engine.execute("ghost", SyncWeights())
    engine.execute("a", Open(lora_spec(tiny_model)))
    engine.execute("a", Close())
    with pytest.raises(UnknownJobError):
        engine.execute("a", OptimStep())
    assert engine.job_ids() == []


def test_close_removes_the_jobs_adapters_and_the_id_can_be_reused(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    engine.execute("b", Open(lora_spec(tiny_model)))
    base = engine._models.get(str(tiny_model))
    assert len(base.adapters.peft_config) == 4  # trainer + sampler adapter per job
    engine.execute("a", Close())
    assert len(base.adapters.peft_config) == 2
    engine.execute("b", Close())
    assert base.adapters is None  # back to the plain base model
    engine.execute("a", Open(lora_spec(tiny_model)))
    train(engine, "a", steps=1)


def test_a_jobs_initial_adapter_depends_on_its_seed_only(tiny_model: Path, tmp_path: Path) -> None:
    alone = Engine()
    alone.execute("a", Open(lora_spec(tiny_model, seed=5)))
    crowded = Engine()
    crowded.execute("x", Open(lora_spec(tiny_model, seed=1)))
    crowded.execute("a", Open(lora_spec(tiny_model, seed=5)))
    a_alone = saved_weights(alone, "a", tmp_path / "alone")
    assert_same_weights(a_alone, saved_weights(crowded, "a", tmp_path / "crowded"))
    x = saved_weights(crowded, "x", tmp_path / "x")
    assert any(not np.array_equal(a_alone[k], x[k]) for k in x)


# -- generate -----------------------------------------------------------------------------------


def test_generate_returns_n_completions_per_prompt_in_prompt_major_order(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    out = generate(engine, "a", n=8, max_tokens=6, stop_token_ids=STOPS)
    assert out.prompt_index_B.dtype == np.int32 and out.prompt_index_B.tolist() == [0] * 8 + [1] * 8
    assert out.tokens.values.dtype == np.int32 and out.logprobs.values.dtype == np.float32
    assert out.tokens.lengths().tolist() == out.logprobs.lengths().tolist()
    assert set(out.finish_reasons) == {"stop", "length"}
    for tokens, reason in zip(out.tokens, out.finish_reasons, strict=True):
        stops = [t in STOPS for t in tokens.tolist()]
        if reason == "stop":
            assert stops[-1] and not any(stops[:-1])  # cut right after the first stop token
        else:
            assert len(tokens) == 6 and not any(stops)
    assert np.all(out.logprobs.values <= 0)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("top_k", [0, 3])
def test_sampler_logprobs_match_the_trainers_after_sync(
    engine: Engine, tiny_model: Path, kind: str, top_k: int
) -> None:
    engine.execute("j", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    train(engine, "j", steps=2)  # nonzero LoRA B / moved weights, published by sync
    out = generate(engine, "j", n=4, max_tokens=8, temperature=1.0, top_k=top_k)
    for sampled, trained in zip(out.logprobs, trainer_logprobs(engine, "j", out), strict=True):
        np.testing.assert_allclose(sampled, trained, atol=1e-4)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_bf16_keeps_the_base_in_bf16_and_the_trained_weights_and_moments_in_fp32(tiny_model: Path, kind: str) -> None:
    engine = Engine(trainer=TrainerSettings(dtype="bfloat16"))
    engine.execute("j", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    job = engine._jobs["j"]
    frozen = [p for name, p in job.base.model.named_parameters() if "lora_" not in name]
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    train(engine, "j", steps=1)
    trained = list(job.weights.trainer_params.values())
    assert {p.dtype for p in trained} == {torch.float32}
    moments = [t for p in trained for t in job.optimizer.state[p].values() if t.ndim > 0]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    out = generate(engine, "j", n=2, max_tokens=6)  # sampling works in bf16 too
    assert np.all(np.isfinite(out.logprobs.values))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_ratio_is_exactly_one_at_the_first_update_and_against_the_sampler_after_a_step(
    tiny_model: Path, dtype: str
) -> None:
    engine = Engine(trainer=TrainerSettings(dtype=dtype))
    engine.execute("j", Open(lora_spec(tiny_model)))
    train(engine, "j", steps=1)  # a nonzero adapter, published: the sampler serves the trainer's weights
    batch = grpo_batch(engine, "j")
    first = run(engine, "j", ForwardBackward(batch, loss="grpo"), ForwardBackwardResult)
    assert first.metrics["ratio_mean"] == 1.0 and first.metrics["recomputed_frac"] == 1.0
    assert 0.0 <= first.metrics["logp_gap_max"] < 0.1
    engine.execute("j", OptimStep())
    # The trainer has stepped past the sampling weights: the ratio is against the sampler's logprobs.
    second = run(engine, "j", ForwardBackward(batch, loss="grpo"), ForwardBackwardResult)
    assert second.metrics["recomputed_frac"] == 0.0 and second.metrics["ratio_mean"] != 1.0


def test_greedy_generation_is_deterministic(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    first = generate(engine, "a", n=2, max_tokens=10, temperature=0.0)
    second = generate(engine, "a", n=2, max_tokens=10, temperature=0.0)
    assert rows(first.tokens) == rows(second.tokens)
    assert rows(first.tokens)[0] == rows(first.tokens)[1]
    assert rows(first.logprobs) == rows(second.logprobs)


def test_sampling_depends_on_the_jobs_seed_and_call_count_only(tiny_model: Path) -> None:
    alone = Engine()
    alone.execute("a", Open(lora_spec(tiny_model, seed=3)))
    busy = Engine()
    busy.execute("x", Open(full_spec(tiny_model, seed=3)))
    generate(busy, "x", n=3, max_tokens=4)
    busy.execute("a", Open(lora_spec(tiny_model, seed=3)))
    train(busy, "x", steps=1)
    for _ in range(2):  # the first and the second call of "a" match across engines
        assert rows(generate(alone, "a", n=3).tokens) == rows(generate(busy, "a", n=3).tokens)
    seeded = [rows(generate(alone, "a", n=3, seed=11).tokens) for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert rows(generate(alone, "a", n=3).tokens) != rows(generate(alone, "a", n=3).tokens)


# -- training -----------------------------------------------------------------------------------


def test_training_one_job_changes_nothing_of_another(engine: Engine, tiny_model: Path, tmp_path: Path) -> None:
    for job, spec in [("a", lora_spec(tiny_model)), ("b", lora_spec(tiny_model, seed=1)), ("c", full_spec(tiny_model))]:
        engine.execute(job, Open(spec))
    train(engine, "b", steps=1)
    before = generate(engine, "b", temperature=0.0, max_tokens=10)
    before_lp = trainer_logprobs(engine, "b", before)
    before_w = saved_weights(engine, "b", tmp_path / "b0")
    a_w = saved_weights(engine, "a", tmp_path / "a0")
    for job in ("a", "c"):
        for _ in range(3):
            engine.execute(job, ForwardBackward(ce_batch(), loss="cross_entropy"))
            engine.execute(
                job, ForwardBackward(grpo_batch(engine, job), loss="grpo", loss_config=LossConfig(kl_coef=0.1))
            )
            engine.execute(job, OptimStep())
            engine.execute(job, SyncWeights())
    after = generate(engine, "b", temperature=0.0, max_tokens=10)
    assert rows(after.tokens) == rows(before.tokens) and rows(after.logprobs) == rows(before.logprobs)
    for x, y in zip(before_lp, trainer_logprobs(engine, "b", after), strict=True):
        np.testing.assert_array_equal(x, y)
    assert_same_weights(before_w, saved_weights(engine, "b", tmp_path / "b1"))
    a_after = saved_weights(engine, "a", tmp_path / "a1")
    assert any(not np.array_equal(a_w[k], a_after[k]) for k in a_w)  # a did train


def grpo_batch(engine: Engine, job: str) -> Batch:
    out = generate(engine, job, n=3, max_tokens=6, stop_token_ids=STOPS)
    samples = [
        Sample(int(p), t, lp, r, out.weight_version)
        for p, t, lp, r in zip(out.prompt_index_B, out.tokens, out.logprobs, out.finish_reasons, strict=True)
    ]
    return Batch.from_samples(PROMPTS, samples, advantages=np.linspace(-1.0, 1.0, len(samples)))


def test_gradients_survive_other_jobs_calls_in_between(tiny_model: Path, tmp_path: Path) -> None:
    busy = Engine()
    busy.execute("a", Open(lora_spec(tiny_model)))
    busy.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy"))
    busy.execute("b", Open(lora_spec(tiny_model, seed=1)))  # a new adapter on the shared model
    train(busy, "b", steps=1)
    busy.execute("c", Open(full_spec(tiny_model)))
    train(busy, "c", steps=1)
    busy.execute("a", OptimStep())
    alone = Engine()
    alone.execute("a", Open(lora_spec(tiny_model)))
    alone.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy"))
    alone.execute("a", OptimStep())
    assert_same_weights(saved_weights(busy, "a", tmp_path / "busy"), saved_weights(alone, "a", tmp_path / "alone"))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_half_batch_calls_step_like_one_full_batch_call(tiny_model: Path, tmp_path: Path, kind: str) -> None:
    # Losses are token sums and optim_step divides by all tokens accumulated since the last step,
    # so the split does not matter (rows of different lengths, to catch per-call means).
    all_rows = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10], [1, 3, 3, 3, 4], [1, 2, 7]]
    # eps >> sqrt(v) makes Adam's update nearly linear in the gradient, so float rounding in the
    # gradient sum stays rounding-sized in the weights (plain Adam amplifies it where m cancels).
    spec = JobSpec(model=str(tiny_model), optimizer=AdamW(lr=1.0, eps=1.0, grad_clip=None))
    weights = []
    for split in ([all_rows], [all_rows[:1], all_rows[1:]]):
        engine = Engine()
        engine.execute("j", Open(spec if kind == "lora" else msgspec.structs.replace(spec, lora=None)))
        for _ in range(2):  # two steps: the second one has nonzero LoRA A gradients too
            for part in split:
                engine.execute("j", ForwardBackward(ce_batch(part), loss="cross_entropy"))
            engine.execute("j", OptimStep())
        weights.append(saved_weights(engine, "j", tmp_path / str(len(split))))
    assert_same_weights(weights[0], weights[1], atol=1e-6)


@pytest.mark.parametrize("max_tokens", [None, 2000, 480, 100])
def test_microbatches_cover_every_row_once_within_the_padding_and_token_bounds(max_tokens: int | None) -> None:
    lengths = np.array([33, 477, 120, 53, 472, 71, 327, 33, 160, 464, 9])
    pieces = microbatches(lengths, max_tokens, waste=0.25)
    assert sorted(np.concatenate(pieces).tolist()) == list(range(len(lengths)))
    for p in pieces:
        assert lengths[p].min() >= 0.75 * lengths[p].max()
        assert max_tokens is None or len(p) == 1 or len(p) * lengths[p].max() <= max_tokens
    assert len(pieces) > 1  # a long-tailed batch is split
    if max_tokens == 100:  # rows longer than the budget go alone
        assert all(len(p) == 1 for p in pieces if lengths[p].max() > 100)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_microbatches_and_chunked_logprobs_change_nothing_a_step_computes(
    tiny_model: Path, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long-tailed GRPO batch trained in one piece with every position's logits at once, and in
    # micro-batches of at most 48 tokens (a backward each) with checkpointed layers and logits
    # 5 positions at a time: the same loss, metrics and weights (up to float rounding).
    rows = [[1, *range(3, 3 + n)] for n in (40, 3, 25, 6, 38, 4, 12)]
    rng = np.random.default_rng(0)
    batch = Batch(
        tokens=Ragged.from_rows(rows, "int32"),
        prompt_lens_B=np.full(len(rows), 2, np.int32),
        sampler_logprobs=Ragged.from_rows([(-rng.random(len(r) - 2)).tolist() for r in rows], "float32"),
        advantages_B=rng.standard_normal(len(rows)).astype(np.float32),
    )
    spec = JobSpec(model=str(tiny_model), optimizer=AdamW(lr=1.0, eps=1.0, grad_clip=None))
    results, weights = [], []
    whole = TrainerSettings(max_tokens_per_microbatch=None, chunk_elements=None)
    pieces = TrainerSettings(max_tokens_per_microbatch=48, chunk_elements=5 * 64)
    for grouped, settings in ((False, whole), (True, pieces)):
        if not grouped:
            monkeypatch.setattr(trainer_job, "microbatches", lambda lengths, budget: [np.arange(len(lengths))])
        else:
            monkeypatch.undo()
        engine = Engine(trainer=settings)
        job_spec = msgspec.structs.replace(spec, gradient_checkpointing=grouped)
        engine.execute("j", Open(job_spec if kind == "lora" else msgspec.structs.replace(job_spec, lora=None)))
        results.append(
            run(
                engine,
                "j",
                ForwardBackward(batch, loss="grpo", loss_config=LossConfig(kl_coef=0.1)),
                ForwardBackwardResult,
            )
        )
        engine.execute("j", OptimStep())
        weights.append(saved_weights(engine, "j", tmp_path / str(grouped)))
    assert results[0].num_tokens == results[1].num_tokens
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-5)
    assert results[0].metrics.keys() == results[1].metrics.keys()
    for k in results[0].metrics:
        assert results[0].metrics[k] == pytest.approx(results[1].metrics[k], rel=1e-5, abs=1e-6), k
    assert_same_weights(weights[0], weights[1], atol=1e-6)


def test_a_failure_after_a_micro_batchs_backward_discards_the_jobs_gradients_and_says_so(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(trainer=TrainerSettings(max_tokens_per_microbatch=8))
    engine.execute("j", Open(lora_spec(tiny_model)))
    engine.execute("j", ForwardBackward(ce_batch(), loss="cross_entropy"))  # accumulated before
    forward, calls = trainer_job.target_logprobs, []

    def nan_on_the_second(*args: Any) -> torch.Tensor:
        calls.append(1)
        logp = forward(*args)
        return logp * float("nan") if len(calls) == 2 else logp

    monkeypatch.setattr(trainer_job, "target_logprobs", nan_on_the_second)
    with pytest.raises(CallFailedError, match=r"after 1 of its micro-batches .*not finite.*gradients were discarded"):
        engine.execute("j", ForwardBackward(ce_batch(), loss="cross_entropy"))
    monkeypatch.undo()
    with pytest.raises(CallFailedError, match="no accumulated gradients"):
        engine.execute("j", OptimStep())  # nothing half-accumulated is left to apply


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_rows_of_zero_advantage_are_not_run_and_the_steps_are_as_if_they_were(
    tiny_model: Path, tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two GRPO steps: a batch with three rows of advantage 0 (a group whose rewards were equal),
    # then one of only such rows. Against the same steps with every row run through the model
    # (``return_logprobs`` needs them all): the same token counts, losses and weights (up to float
    # rounding; the second step moves the weights by AdamW's momentum alone, as a zero gradient does).
    rows = [[1, *range(3, 3 + n)] for n in (40, 3, 25, 6, 38, 4, 12)]
    rng = np.random.default_rng(1)

    def batch(advantages: list[float]) -> Batch:
        return Batch(
            tokens=Ragged.from_rows(rows, "int32"),
            prompt_lens_B=np.full(len(rows), 2, np.int32),
            sampler_logprobs=Ragged.from_rows([(-rng.random(len(r) - 2)).tolist() for r in rows], "float32"),
            advantages_B=np.array(advantages, np.float32),
        )

    batches = [batch([0.5, 0.0, -1.2, 0.0, 0.9, 0.0, -0.3]), batch([0.0] * len(rows))]
    forwarded: list[int] = []
    forward = trainer_job.target_logprobs
    monkeypatch.setattr(
        trainer_job,
        "target_logprobs",
        lambda model, tokens, *a: forwarded.append(len(tokens)) or forward(model, tokens, *a),
    )
    spec = JobSpec(model=str(tiny_model), optimizer=AdamW(lr=1.0, eps=1.0, grad_clip=None))
    results, weights, rows_run = [], [], []
    for run_all in (False, True):
        engine = Engine()
        engine.execute("j", Open(spec if kind == "lora" else msgspec.structs.replace(spec, lora=None)))
        for b in batches:
            forwarded.clear()
            call = ForwardBackward(b, loss="grpo", return_logprobs=run_all)
            results.append(run(engine, "j", call, ForwardBackwardResult))
            rows_run.append(sum(forwarded))
            engine.execute("j", OptimStep())
        weights.append(saved_weights(engine, "j", tmp_path / str(run_all)))
    assert rows_run == [4, 0, 7, 7]  # skipped: the zero rows; run_all: every row, every step
    skipped, everything = results[:2], results[2:]
    for a, b in zip(skipped, everything, strict=True):
        assert a.num_tokens == b.num_tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
    assert skipped[1].loss == 0.0
    assert_same_weights(weights[0], weights[1], atol=1e-6)


def test_optim_step_counts_steps_and_reports_the_pre_clip_grad_norm(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(JobSpec(model=str(tiny_model), optimizer=AdamW(grad_clip=1e-6))))
    for step in (1, 2):
        engine.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy"))
        result = run(engine, "a", OptimStep(), OptimStepResult)
        assert result.step == step and result.grad_norm > 1e-3


def test_optim_step_without_gradients_fails(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    with pytest.raises(CallFailedError, match="forward_backward first"):
        engine.execute("a", OptimStep())
    train(engine, "a", steps=1, sync=False)
    with pytest.raises(CallFailedError, match="no accumulated gradients"):
        engine.execute("a", OptimStep())


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_grpo_kl_to_the_base_is_zero_before_training(engine: Engine, tiny_model: Path, kind: str) -> None:
    engine.execute("j", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    batch = grpo_batch(engine, "j")
    call = ForwardBackward(batch, loss="grpo", loss_config=LossConfig(kl_coef=0.5))
    first = run(engine, "j", call, ForwardBackwardResult)
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    engine.execute("j", OptimStep())
    assert run(engine, "j", call, ForwardBackwardResult).metrics["kl"] > 1e-6


def test_a_rows_logprobs_do_not_depend_on_the_rows_padded_beside_it(engine: Engine, tiny_model: Path) -> None:
    """Rows of different lengths in one call (padded on the right to the longest) score each token
    as the row alone does: padding never reaches a real token."""
    engine.execute("a", Open(lora_spec(tiny_model)))
    batch = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14, 15], [2, 9, 8, 7, 6]]
    together = run(engine, "a", Logprobs(Ragged.from_rows(batch, "int32")), LogprobsResult).logprobs
    for row, lp in zip(batch, together, strict=True):
        alone = run(engine, "a", Logprobs(Ragged.from_rows([row], "int32")), LogprobsResult).logprobs[0]
        assert len(lp) == len(row) - 1
        np.testing.assert_allclose(lp, alone, rtol=0, atol=1e-5)


def test_masked_observation_tokens_add_nothing_to_the_loss(engine: Engine, tiny_model: Path) -> None:
    """A multi-turn row: prompt, sampled, observation (mask 0), sampled. Whatever the observation's
    logprobs say, the loss and its token count are those of the sampled tokens alone."""
    engine.execute("a", Open(lora_spec(tiny_model)))
    row = [1, 5, 6, 7, 8, 9, 10, 11]  # prompt [1, 5]; tokens 8 and 9 came from a tool
    own = run(engine, "a", Logprobs(Ragged.from_rows([row], "int32")), LogprobsResult).logprobs[0][1:]
    mask = np.array([1, 1, 0, 0, 1, 1], np.int8)

    def loss(observation_logprob: float, loss_mask: np.ndarray | None) -> ForwardBackwardResult:
        logprobs = np.where(mask == 1, own, observation_logprob).astype(np.float32)
        batch = Batch(
            tokens=Ragged.from_rows([row], "int32"), prompt_lens_B=np.array([2], np.int32),
            sampler_logprobs=Ragged.from_rows([logprobs], "float32"), advantages_B=np.array([1.0], np.float32),
            loss_mask=None if loss_mask is None else Ragged.from_rows([loss_mask], "int8"),
        )  # fmt: skip
        return run(engine, "a", ForwardBackward(batch, loss="grpo"), ForwardBackwardResult)

    masked, garbage = loss(-1.0, mask), loss(-30.0, mask)
    assert masked.num_tokens == garbage.num_tokens == 4
    assert masked.loss == pytest.approx(garbage.loss, abs=1e-6)
    assert masked.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # only the sampled tokens' ratios
    unmasked = loss(-30.0, None)
    assert unmasked.num_tokens == 6 and unmasked.metrics["ratio_mean"] > 1.0  # the mask is what kept them out


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss_mask": [[1, 1]]}, "loss_mask needs one value per completion token"),
        ({"loss_mask": [[1, 2, 0, 0]]}, "1 \\(in the loss\\) or 0"),
        ({"loss_mask": [[0, 0, 0, 0]]}, "at least one completion token in the loss"),
        ({"token_versions": [[0, 0, 0]]}, "token_versions needs one value per completion token"),
    ],
)
def test_per_token_fields_must_match_the_completion(change: dict[str, list[list[int]]], match: str) -> None:
    fields = {k: Ragged.from_rows(v, "int8" if k == "loss_mask" else "int64") for k, v in change.items()}
    batch = Batch(
        tokens=Ragged.from_rows([[1, 5, 6, 7, 8, 9]], "int32"), prompt_lens_B=np.array([2], np.int32), **fields
    )
    with pytest.raises(BatchShapeError, match=match):
        batch.validate("cross_entropy")


def test_per_token_weights_and_advantages_weigh_each_tokens_loss(engine: Engine, tiny_model: Path) -> None:
    """Tinker's datums: cross_entropy weighted per token is the weighted sum of the tokens' -logprob;
    importance_sampling with per-token advantages is -sum(ratio * A) over the tokens."""
    engine.execute("a", Open(lora_spec(tiny_model)))
    row = [1, 5, 6, 7, 8, 9]  # prompt [1]: five target tokens
    own = run(engine, "a", Logprobs(Ragged.from_rows([row], "int32")), LogprobsResult).logprobs[0]
    weights = np.array([0.0, 1.0, 2.0, 0.0, 0.5], np.float32)
    tokens, prompt = Ragged.from_rows([row], "int32"), np.array([1], np.int32)
    ce = Batch(tokens=tokens, prompt_lens_B=prompt, token_weights=Ragged.from_rows([weights], "float32"))
    out = run(engine, "a", ForwardBackward(ce, loss="cross_entropy", forward_only=True, return_logprobs=True),
              ForwardBackwardResult)  # fmt: skip
    assert out.loss_sum == pytest.approx(float(-(weights * own).sum()), rel=1e-5)
    assert out.logprobs is not None
    np.testing.assert_allclose(out.logprobs[0], own, rtol=0, atol=1e-5)  # the trainer's, per target token
    advantages = np.array([1.0, -2.0, 0.0, 0.5, 3.0], np.float32)
    sampled = own - 0.1  # the sampler's: every ratio is e^0.1
    is_batch = Batch(tokens=tokens, prompt_lens_B=prompt, sampler_logprobs=Ragged.from_rows([sampled], "float32"),
                     token_advantages=Ragged.from_rows([advantages], "float32"))  # fmt: skip
    out = run(engine, "a", ForwardBackward(is_batch, loss="importance_sampling", forward_only=True),
              ForwardBackwardResult)  # fmt: skip
    assert out.loss_sum == pytest.approx(float(-(np.exp(0.1) * advantages).sum()), rel=1e-4)


def test_forward_only_accumulates_nothing_and_sum_reduction_steps_on_the_summed_loss(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A forward-only call leaves no gradient (the step after it fails); a ``sum`` step with lr
    scaled down by the token count moves the weights as a ``mean`` step does (Adam is scale-free up
    to eps, so the same update needs the same direction, not the same lr); a step's own AdamW
    settings override the job's."""
    engine = Engine()
    engine.execute("a", Open(lora_spec(tiny_model)))
    engine.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy", forward_only=True))
    with pytest.raises(CallFailedError, match="no accumulated gradients"):
        engine.execute("a", OptimStep())
    after: dict[str, dict[str, np.ndarray]] = {}
    for job, step in (("mean", OptimStep()), ("sum", OptimStep(reduction="sum")),
                      ("slow", OptimStep(adam=AdamW(lr=FAST.lr / 100, grad_clip=None)))):  # fmt: skip
        engine.execute(job, Open(lora_spec(tiny_model, seed=1)))
        engine.execute(job, ForwardBackward(ce_batch(), loss="cross_entropy"))
        engine.execute(job, step)
        after[job] = saved_weights(engine, job, tmp_path / job)
    moved = {job: sum(float(np.abs(w[k] - after["mean"][k]).max()) for k in w) for job, w in after.items()}
    assert moved["sum"] < 1e-4  # Adam normalises the gradient's scale away (grad_clip off the path here)
    assert moved["slow"] > 1e-6  # its own lr made a different step
    with pytest.raises(InvalidRequestError, match="reduction"):
        engine.execute("a", OptimStep(reduction="max"))


# -- weight versions ----------------------------------------------------------------------------


def test_sync_weights_increments_the_version_that_generate_reports(engine: Engine, tiny_model: Path) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    assert generate(engine, "a").weight_version == 0
    for version in (1, 2):
        assert run(engine, "a", SyncWeights(), Synced).weight_version == version
        assert generate(engine, "a").weight_version == version


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_sampler_keeps_the_old_weights_until_sync(engine: Engine, tiny_model: Path, kind: str) -> None:
    engine.execute("j", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    before = generate(engine, "j", n=2, seed=7)
    train(engine, "j", steps=3, sync=False)
    stale = generate(engine, "j", n=2, seed=7)
    assert stale.weight_version == 0
    assert rows(stale.tokens) == rows(before.tokens) and rows(stale.logprobs) == rows(before.logprobs)
    trained = trainer_logprobs(engine, "j", stale)
    assert any(not np.allclose(x, y, atol=1e-4) for x, y in zip(stale.logprobs, trained, strict=True))
    engine.execute("j", SyncWeights())
    fresh = generate(engine, "j", n=2, seed=7)
    assert fresh.weight_version == 1 and rows(fresh.logprobs) != rows(before.logprobs)


# -- save / load --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_load_restores_weights_optimizer_step_and_version(tiny_model: Path, tmp_path: Path, kind: str) -> None:
    engine = Engine()
    engine.execute("j", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    train(engine, "j", steps=2)
    saved = run(engine, "j", Save(str(tmp_path / "ckpt")), Saved)
    assert (saved.weight_version, saved.step) == (1, 2)
    sample_at_save = generate(engine, "j", seed=3)
    train(engine, "j", steps=1)
    continued = saved_weights(engine, "j", tmp_path / "continued")
    train(engine, "j", steps=2)  # wander off, then come back
    loaded = run(engine, "j", Load(str(tmp_path / "ckpt")), Loaded)
    assert (loaded.weight_version, loaded.step) == (1, 2)
    reloaded = generate(engine, "j", seed=3)
    assert reloaded.weight_version == 1 and rows(reloaded.tokens) == rows(sample_at_save.tokens)
    train(engine, "j", steps=1)  # equal only if the Adam moments came back too
    assert_same_weights(continued, saved_weights(engine, "j", tmp_path / "again"), atol=1e-6)
    assert generate(engine, "j").weight_version == 2


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_job_restored_elsewhere_from_its_snapshot_and_replay_continues_exactly(
    tiny_model: Path, tmp_path: Path, kind: str
) -> None:
    """What the coordinator does when a job's worker dies: the snapshot of its last optim_step,
    then its forward_backward and sync_weights calls since, on another engine. The sampler serves
    the version it served (weights older than the trainer's: it stepped after the last sync), and
    the next step lands where it would have: Adam moments and pending gradients included."""
    spec = lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)
    first, second = Engine(), Engine()
    first.execute("j", Open(spec, snapshot_max_bytes=SNAPSHOTS))
    train(first, "j", steps=1)
    first.execute("j", ForwardBackward(ce_batch(), loss="cross_entropy"))
    stepped = run(first, "j", OptimStep(snapshot=True), OptimStepResult)  # stepped past the sync: v1 = step 1
    assert stepped.snapshot is not None and stepped.snapshot.sampler is not None
    replay = [ForwardBackward(ce_batch([[1, 5, 6, 7, 8]]), loss="cross_entropy"), SyncWeights()]
    served = generate(first, "j", seed=4)
    for call in replay:
        first.execute("j", call)
    restored = run(second, "j", Restore(Open(spec, snapshot_max_bytes=SNAPSHOTS), stepped.snapshot, replay), Opened)
    assert restored.weight_version == 2
    # Before the replay's sync, the restored sampler served what the original's did.
    again = Engine()
    run(again, "j", Restore(Open(spec, snapshot_max_bytes=SNAPSHOTS), stepped.snapshot, []), Opened)
    assert rows(generate(again, "j", seed=4).tokens) == rows(served.tokens)
    for engine in (first, second):
        engine.execute("j", ForwardBackward(ce_batch(), loss="cross_entropy"))
        assert run(engine, "j", OptimStep(), OptimStepResult).step == 3
    assert_same_weights(saved_weights(first, "j", tmp_path / "a"), saved_weights(second, "j", tmp_path / "b"))
    assert rows(generate(first, "j", seed=5).logprobs) == rows(generate(second, "j", seed=5).logprobs)


def test_a_restore_that_fails_leaves_no_job_behind(engine: Engine, tiny_model: Path) -> None:
    other = Engine()
    other.execute("j", Open(lora_spec(tiny_model, rank=8), snapshot_max_bytes=SNAPSHOTS))
    other.execute("j", ForwardBackward(ce_batch(), loss="cross_entropy"))
    snap = run(other, "j", OptimStep(snapshot=True), OptimStepResult).snapshot
    with pytest.raises(CallFailedError, match="does not fit"):
        engine.execute("j", Restore(Open(lora_spec(tiny_model, rank=4), snapshot_max_bytes=SNAPSHOTS), snap))
    with pytest.raises(UnknownJobError):
        engine.execute("j", SyncWeights())


def test_save_writes_the_manifest_last_then_renames_into_place(
    engine: Engine, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    synced: list[str] = []
    real_sync = checkpoint._sync_file

    def record(f: Path) -> None:
        synced.append(f.name)
        real_sync(f)

    monkeypatch.setattr(checkpoint, "_sync_file", record)
    engine.execute("a", Save(str(tmp_path / "ckpt")))
    assert sorted(synced[:2]) == sorted([checkpoint.WEIGHTS, checkpoint.OPTIMIZER]) and synced[2] == checkpoint.MANIFEST
    assert synced[3].startswith("ckpt.tmp-")  # the directory, fsynced before the rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(
        [checkpoint.WEIGHTS, checkpoint.OPTIMIZER, checkpoint.MANIFEST]
    )


def test_a_failed_save_leaves_the_previous_checkpoint_intact(
    engine: Engine, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    path = str(tmp_path / "ckpt")
    engine.execute("a", Save(path))
    train(engine, "a", steps=1)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        engine.execute("a", Save(path))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    loaded = run(engine, "a", Load(path), Loaded)
    assert (loaded.weight_version, loaded.step) == (0, 0)


def test_save_replaces_a_previous_checkpoint_but_no_other_directory(
    engine: Engine, tiny_model: Path, tmp_path: Path
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    engine.execute("a", Save(str(tmp_path / "ckpt")))
    train(engine, "a", steps=1)
    assert run(engine, "a", Save(str(tmp_path / "ckpt")), Saved).step == 1
    assert run(engine, "a", Load(str(tmp_path / "ckpt")), Loaded).step == 1
    (tmp_path / "data").mkdir()
    with pytest.raises(InvalidRequestError, match="not a plexrl checkpoint"):
        engine.execute("a", Save(str(tmp_path / "data")))


def corrupt(path: Path, how: str) -> None:
    if how == "no_manifest":
        (path / checkpoint.MANIFEST).unlink()
    elif how == "bad_manifest":
        (path / checkpoint.MANIFEST).write_text("{not json")
    elif how == "truncated_weights":
        data = (path / checkpoint.WEIGHTS).read_bytes()
        (path / checkpoint.WEIGHTS).write_bytes(data[: len(data) // 2])
    elif how == "garbage_optimizer":
        size = (path / checkpoint.OPTIMIZER).stat().st_size
        (path / checkpoint.OPTIMIZER).write_bytes(b"x" * size)


@pytest.mark.parametrize("how", ["missing", "no_manifest", "bad_manifest", "truncated_weights", "garbage_optimizer"])
def test_load_of_a_missing_or_corrupt_checkpoint_fails_and_changes_nothing(
    engine: Engine, tiny_model: Path, tmp_path: Path, how: str
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    path = tmp_path / "ckpt"
    if how != "missing":
        engine.execute("a", Save(str(path)))
        corrupt(path, how)
    train(engine, "a", steps=1)
    before = saved_weights(engine, "a", tmp_path / "before")
    with pytest.raises(CallFailedError, match="ckpt"):
        engine.execute("a", Load(str(path)))
    assert_same_weights(before, saved_weights(engine, "a", tmp_path / "after"))
    assert generate(engine, "a").weight_version == 1


def test_load_of_a_checkpoint_of_another_shape_fails_and_changes_nothing(
    engine: Engine, tiny_model: Path, tmp_path: Path
) -> None:
    engine.execute("r8", Open(lora_spec(tiny_model, rank=8)))
    engine.execute("r8", Save(str(tmp_path / "r8")))
    engine.execute("r4", Open(lora_spec(tiny_model, rank=4)))
    engine.execute("f", Open(full_spec(tiny_model)))
    train(engine, "r4", steps=1)
    before = saved_weights(engine, "r4", tmp_path / "before")
    with pytest.raises(CallFailedError, match="spec it was saved with"):
        engine.execute("r4", Load(str(tmp_path / "r8")))
    with pytest.raises(CallFailedError, match="lora checkpoint but this job is full"):
        engine.execute("f", Load(str(tmp_path / "r8")))
    assert_same_weights(before, saved_weights(engine, "r4", tmp_path / "after"))


# -- bad input ----------------------------------------------------------------------------------


def prompts(*rows: list[int]) -> Ragged:
    return Ragged.from_rows(rows, "int32")


BAD_CALLS: list[tuple[str, Call, type[Exception], str]] = [
    ("token id = vocab", Generate(prompts([1, 64])), BatchShapeError, "token ids must be in"),
    ("negative token id", Logprobs(prompts([1, -1])), BatchShapeError, "token ids must be in"),
    ("empty prompt", Generate(prompts([1, 2], [])), BatchShapeError, "at least 1 token"),
    ("no prompts", Generate(prompts()), BatchShapeError, "no rows"),
    ("float tokens", Generate(Ragged.from_rows([[1.0, 2.0]], "float32")), BatchShapeError, "integers"),
    (
        "prompt + max_tokens too long",
        Generate(prompts([1] * 1000), SamplingParams(max_tokens=100)),
        BatchShapeError,
        "max_position_embeddings=1024",
    ),
    ("n = 0", Generate(prompts([1]), SamplingParams(n=0)), InvalidSamplingParamsError, "n=0"),
    ("stop id = vocab", Generate(prompts([1]), SamplingParams(stop_token_ids=(64,))), InvalidSamplingParamsError, "64"),
    (
        "training token id out of range",
        ForwardBackward(ce_batch([[1, 2, 99]]), loss="cross_entropy"),
        BatchShapeError,
        "token ids must be in",
    ),
    (
        "prompt_lens_B of the wrong length",
        ForwardBackward(Batch(tokens=prompts([1, 2, 3]), prompt_lens_B=np.array([1, 1], np.int32)), "cross_entropy"),
        BatchShapeError,
        "prompt_lens_B",
    ),
    (
        "no completion tokens",
        ForwardBackward(Batch(tokens=prompts([1, 2, 3]), prompt_lens_B=np.array([3], np.int32)), "cross_entropy"),
        BatchShapeError,
        "completion token",
    ),
    ("grpo without advantages", ForwardBackward(ce_batch(), loss="grpo"), BatchShapeError, "advantages"),
    ("unknown loss", ForwardBackward(ce_batch(), loss="dpo"), BatchShapeError, "unknown loss"),
    (
        "bad loss config",
        ForwardBackward(ce_batch(), loss="cross_entropy", loss_config=LossConfig(temperature=0.0)),
        InvalidRequestError,
        "temperature",
    ),
    ("optim_step first", OptimStep(), CallFailedError, "forward_backward first"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_gets_a_typed_error_and_changes_nothing(
    engine: Engine, tiny_model: Path, call: Call, error: type[Exception], match: str
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    with pytest.raises(error, match=match):
        engine.execute("a", call)
    with pytest.raises(CallFailedError, match="no accumulated gradients"):
        engine.execute("a", OptimStep())  # a rejected forward_backward accumulated nothing
    assert generate(engine, "a").weight_version == 0


def test_training_on_samples_of_other_weights_is_refused_and_accumulates_nothing(
    engine: Engine, tiny_model: Path
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    stale = grpo_batch(engine, "a")  # sampled by version 0
    run(engine, "a", ForwardBackward(stale, loss="grpo"), ForwardBackwardResult)  # on-policy: fine
    engine.execute("a", OptimStep())
    engine.execute("a", SyncWeights())  # the trainer is at version 1 now
    with pytest.raises(StaleSamplesError, match=r"version\(s\) \[0\].*version 1"):
        engine.execute("a", ForwardBackward(stale, loss="grpo"))
    with pytest.raises(CallFailedError, match="no accumulated gradients"):
        engine.execute("a", OptimStep())
    fresh = grpo_batch(engine, "a")
    assert set(fresh.weight_versions_B.tolist()) == {1}  # type: ignore[union-attr]
    run(engine, "a", ForwardBackward(fresh, loss="grpo"), ForwardBackwardResult)


def test_max_staleness_admits_samples_up_to_k_versions_old_and_refuses_older(engine: Engine, tiny_model: Path) -> None:
    spec = JobSpec(model=str(tiny_model), lora=LoRA(rank=4), optimizer=FAST, max_staleness=1)
    engine.execute("a", Open(spec))
    old = grpo_batch(engine, "a")  # version 0
    fresh = run(engine, "a", ForwardBackward(old, loss="decoupled_ppo"), ForwardBackwardResult)
    assert fresh.metrics["staleness_max"] == 0.0
    engine.execute("a", OptimStep())
    engine.execute("a", SyncWeights())  # version 1: the old samples are one version behind, k = 1
    result = run(engine, "a", ForwardBackward(old, loss="decoupled_ppo"), ForwardBackwardResult)
    assert result.metrics["staleness_mean"] == result.metrics["staleness_max"] == 1.0
    assert result.metrics["is_weight_mean"] != pytest.approx(1.0)  # the trainer moved: the weights correct for it
    engine.execute("a", OptimStep())
    engine.execute("a", SyncWeights())  # version 2: two behind
    with pytest.raises(StaleSamplesError, match=r"version\(s\) \[0\].*versions 1\.\.2 \(max_staleness=1\)"):
        engine.execute("a", ForwardBackward(old, loss="decoupled_ppo"))
    with pytest.raises(InvalidRequestError, match="max_staleness=-1 must be >= 0"):
        engine.execute("b", Open(JobSpec(model=str(tiny_model), max_staleness=-1)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("min_tokens", [3, 6])
def test_min_tokens_holds_back_eos_and_stop_tokens(
    engine: Engine, tiny_model: Path, min_tokens: int, temperature: float
) -> None:
    engine.execute("a", Open(lora_spec(tiny_model)))
    free = generate(engine, "a", n=8, max_tokens=6, stop_token_ids=STOPS)
    assert min(free.tokens.lengths()) < 3  # the stop tokens are live: without min_tokens rows end early
    out = generate(engine, "a", n=8, max_tokens=6, min_tokens=min_tokens, temperature=temperature, stop_token_ids=STOPS)
    lens = out.tokens.lengths().tolist()
    assert len(lens) == 16 and min(lens) >= min_tokens and out.logprobs.lengths().tolist() == lens
    ends = {*STOPS, 2}  # and the model's EOS
    for tokens, reason in zip(out.tokens, out.finish_reasons, strict=True):
        assert not any(t in ends for t in tokens[:-1].tolist())
        assert reason == ("stop" if tokens[-1] in ends else "length")
    if min_tokens == 6:  # min_tokens == max_tokens: every row is full length
        assert lens == [6] * 16 and out.finish_reasons == ["length"] * 16
    # The hf sampler reports logprobs of the unmasked distribution, as the trainer computes them.
    for sampled, trained in zip(out.logprobs, trainer_logprobs(engine, "a", out), strict=True):
        np.testing.assert_allclose(sampled, trained, atol=1e-4)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_an_open_runs_beside_other_jobs_calls_and_enters_the_job_whole(
    engine: Engine, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """``start`` runs an open on a thread of its own: while its slow part waits (here, loading the
    base model), another job trains, steps and samples on the main thread; the job is then open."""
    run(engine, "busy", Open(spec=lora_spec(tiny_model)), Opened)
    gate, loading = threading.Event(), threading.Event()
    load = engine._models.get

    def slow_load(path: str) -> Any:
        loading.set()
        assert gate.wait(60), "the test never let the open go on"
        return load(path)

    monkeypatch.setattr(engine._models, "get", slow_load)
    spec = lora_spec(tiny_model, seed=3) if kind == "lora" else full_spec(tiny_model, seed=3)
    opening = engine.start("new", Open(spec=spec))
    assert opening is not None
    try:
        assert loading.wait(60)
        train(engine, "busy", steps=2)
        generate(engine, "busy", max_tokens=4)
        assert not opening.done() and engine.job_ids() == ["busy"]  # nothing of it entered yet
    finally:
        gate.set()
    opened = opening.result(timeout=60)
    assert isinstance(opened, Opened) and opened.weight_version == 0
    assert sorted(engine.job_ids()) == ["busy", "new"]
    generate(engine, "new", max_tokens=4)
    train(engine, "new", steps=1)


def test_a_save_runs_beside_other_jobs_calls(
    engine: Engine, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint being written (here held at its write) keeps no other job waiting, and what it
    wrote is the job's state when it started."""
    for job in ("saving", "busy"):
        run(engine, job, Open(spec=lora_spec(tiny_model, seed=len(job))), Opened)
    train(engine, "saving", steps=1)
    gate, writing = threading.Event(), threading.Event()
    write = checkpoint.write

    def slow_write(*args: Any) -> None:
        writing.set()
        assert gate.wait(60), "the test never let the save go on"
        write(*args)

    monkeypatch.setattr(checkpoint, "write", slow_write)
    saving = engine.start("saving", Save(path=str(tmp_path / "ckpt")))
    assert saving is not None
    try:
        assert writing.wait(60)
        train(engine, "busy", steps=2)
        generate(engine, "busy", max_tokens=4)
        assert not saving.done()
    finally:
        gate.set()
    saved = saving.result(timeout=60)
    assert isinstance(saved, Saved) and saved.step == 1
    first = {k: v.numpy() for k, v in load_file(str(tmp_path / "ckpt" / checkpoint.WEIGHTS)).items()}
    assert_same_weights(saved_weights(engine, "saving", tmp_path / "again"), first)
